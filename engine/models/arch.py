"""Model architecture description, whatever the checkpoint's format: a frozen `ModelArch`.

The readers of each format build one (engine/models/hf_config.py from config.json,
engine/models/gguf_file.py from GGUF metadata; engine/models/formats.py picks the reader), the
model family's module sets its own fields (engine/models/families/). `ModelArch` validates
everything the model code relies on, so a checkpoint we cannot run fails when it is read with a
ValueError that names the offending field, never later inside a forward.
"""

from __future__ import annotations

from dataclasses import dataclass

ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. `rope_type` is one of default / linear / llama3.

    `factor` is used by linear and llama3; the three llama3 fields only by llama3.
    """

    rope_type: str = "default"
    theta: float = DEFAULT_ROPE_THETA
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope_type!r} (supported: {ROPE_TYPES})")
        if self.theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.theta}")
        if self.rope_type != "default" and self.factor <= 0:
            raise ValueError(f"rope factor must be positive, got {self.factor}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope needs high_freq_factor > low_freq_factor")


@dataclass(frozen=True)
class ModelArch:
    """Shape and hyper-parameters of one decoder-only model; immutable once loaded."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: list[int]
    tie_word_embeddings: bool
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "vocab_size", "max_position_embeddings", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embedding, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        """Softmax scale the attention callback must use: 1 / sqrt(head_dim)."""
        return self.head_dim ** -0.5
