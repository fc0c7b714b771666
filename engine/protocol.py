"""Typed messages that cross process boundaries (msgspec structs, msgpack on the wire).

Invariant: everything here is plain data. No struct holds a callable, a tensor that is
not encoded by `engine.serial`, or anything that would need pickle.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

_SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
    "stop", "stop_token_ids", "ignore_eos", "logprobs", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "include_stop_str_in_output",
    "skip_special_tokens", "output_kind",
)


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingParams(
    msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    """Per-request sampling options. Validated on construction; errors name the field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __init__(self, **kwargs: Any) -> None:  # noqa: D107 - replaced below
        raise AssertionError("replaced at import")

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _validate_sampling(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self.stop_token_ids)


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{field} {msg}")


def _validate_sampling(p: SamplingParams) -> None:
    _check(isinstance(p.n, int) and p.n >= 1, "n", f"must be at least 1, got {p.n!r}")
    _check(p.temperature >= 0, "temperature", f"must be non-negative, got {p.temperature}")
    _check(0 < p.top_p <= 1, "top_p", f"must be in (0, 1], got {p.top_p}")
    _check(p.top_k >= -1, "top_k", f"must be -1, 0 (disabled) or positive, got {p.top_k}")
    _check(0 <= p.min_p <= 1, "min_p", f"must be in [0, 1], got {p.min_p}")
    _check(
        p.max_tokens is None or p.max_tokens >= 1,
        "max_tokens", f"must be at least 1, got {p.max_tokens}",
    )
    _check(p.min_tokens >= 0, "min_tokens", f"must be non-negative, got {p.min_tokens}")
    _check(
        p.max_tokens is None or p.min_tokens <= p.max_tokens,
        "min_tokens", f"must not exceed max_tokens ({p.max_tokens}), got {p.min_tokens}",
    )
    _check(
        p.logprobs is None or 0 <= p.logprobs <= 20,
        "logprobs", f"must be in [0, 20], got {p.logprobs}",
    )
    _check(-2 <= p.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
    _check(-2 <= p.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
    _check(p.repetition_penalty > 0, "repetition_penalty", "must be positive")
    _check(all(isinstance(s, str) and s for s in p.stop), "stop", "must be non-empty strings")
    _check(
        all(isinstance(t, int) and t >= 0 for t in p.stop_token_ids),
        "stop_token_ids", "must be non-negative integers",
    )


_struct_init = msgspec.Struct.__init__


def _sampling_init(self: SamplingParams, **kwargs: Any) -> None:
    unknown = sorted(set(kwargs) - set(_SAMPLING_FIELDS))
    if unknown:
        raise ValueError(f"unknown sampling field(s): {', '.join(unknown)}")
    values = {f: getattr(SamplingParams, "__struct_defaults__")[i]
              for i, f in enumerate(SamplingParams.__struct_fields__)}
    values.update(kwargs)
    for name, value in values.items():
        if isinstance(value, (list, dict)):
            value = type(value)(value)
        setattr(self, name, value)
    try:
        checked = msgspec.convert(msgspec.to_builtins(values), SamplingParams, strict=False)
    except msgspec.ValidationError as e:
        raise ValueError(f"invalid sampling parameters: {e}") from None
    for name in SamplingParams.__struct_fields__:
        setattr(self, name, getattr(checked, name))


SamplingParams.__init__ = _sampling_init  # type: ignore[method-assign]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request as the EngineCore sees it: already tokenized and validated."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float = 0.0
    kv_transfer_params: dict[str, Any] | None = None


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return ("stop", "length", "abort", "error")[self.value]


class Logprobs(msgspec.Struct, array_like=True):
    """Logprobs of one sampled position: the sampled token first, then the top-N."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None  # set with FinishReason.ERROR: why the core gave up

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityOutput(msgspec.Struct, array_like=True):
    call_id: int
    failure_message: str | None = None
    result: Any = None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_connector: dict[str, float] = {}


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    finished_requests: list[str] | None = None  # ids the core finished on its own


class EngineCoreRequestType(enum.Enum):
    """First frame of every message on the input socket."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"


def now() -> float:
    return time.monotonic()
