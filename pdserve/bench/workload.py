"""Workloads for `pdserve bench serve`: which prompts are sent, and how many tokens each wants.

Three sources, all deterministic for a given seed:
  - random: `n` prompts of exactly `input_len` random token ids (sent as a token-id list, so
    the server sees exactly that many prompt tokens), each asking for `output_len` tokens;
  - mix: a weighted mix of random classes, e.g. "0.9:64:64,0.1:1024:64" — the class counts are
    exact (largest-remainder rounding of weight * n) and their order is a seeded shuffle;
  - jsonl: one JSON object per line, `{"prompt": str | [int, ...], "output_len": int?}`.

Token ids are drawn from the model's vocabulary without its special tokens when a model
directory is known (config.json `vocab_size`, tokenizer.json `added_tokens`), else from a
range of ids every real vocabulary has.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

# ids every tokenizer has, used when no model directory tells us the vocabulary
FALLBACK_TOKEN_RANGE = (100, 1000)


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. `prompt_len` is None when the prompt is text whose token
    count only the server knows (it is then read from the response's usage)."""

    prompt: str | list[int]
    prompt_len: int | None
    output_len: int
    kind: str  # class label, e.g. "1024x64"; "jsonl" for dataset prompts

    def __post_init__(self) -> None:
        if self.output_len < 1:
            raise ValueError(f"output_len must be at least 1, got {self.output_len}")
        if not self.prompt:
            raise ValueError("a benchmark prompt must not be empty")


@dataclass(frozen=True)
class MixClass:
    weight: float
    input_len: int
    output_len: int

    @property
    def label(self) -> str:
        return f"{self.input_len}x{self.output_len}"


def parse_mix(spec: str) -> list[MixClass]:
    """'W:IN:OUT,W:IN:OUT,…' → classes (weights need not sum to 1; they are normalised)."""
    classes = []
    for part in spec.split(","):
        fields = part.strip().split(":")
        if len(fields) != 3:
            raise ValueError(f"bad mix class {part!r}: expected WEIGHT:INPUT_LEN:OUTPUT_LEN")
        try:
            cls = MixClass(float(fields[0]), int(fields[1]), int(fields[2]))
        except ValueError:
            raise ValueError(f"bad mix class {part!r}: expected numbers") from None
        if cls.weight <= 0 or cls.input_len < 1 or cls.output_len < 1:
            raise ValueError(f"bad mix class {part!r}: weight and lengths must be positive")
        classes.append(cls)
    labels = [c.label for c in classes]
    if len(set(labels)) != len(labels):
        raise ValueError(f"mix {spec!r} lists one INPUT_LENxOUTPUT_LEN class twice")
    return classes


def token_pool(model_dir: str | None) -> list[int]:
    """Token ids safe to put in a prompt: the vocabulary minus special/added tokens."""
    if model_dir is not None and not os.path.isdir(model_dir):
        return _gguf_token_pool(model_dir)
    if model_dir is None or not os.path.isfile(os.path.join(model_dir, "config.json")):
        return list(range(*FALLBACK_TOKEN_RANGE))
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    special: set[int] = set()
    tok_path = os.path.join(model_dir, "tokenizer.json")
    if os.path.isfile(tok_path):
        with open(tok_path) as f:
            special = {int(t["id"]) for t in json.load(f).get("added_tokens", [])}
    pool = [t for t in range(vocab) if t not in special]
    if not pool:
        raise ValueError(f"model {model_dir} has no non-special token ids")
    return pool


def _gguf_token_pool(model: str) -> list[int]:
    """A .gguf file or a packaged alias: vocabulary and specials from the file's metadata;
    anything else (a served name that is no local model) gets the fallback range."""
    from engine.models.source import is_gguf, resolve_model

    try:
        path = resolve_model(model)
    except ValueError:
        return list(range(*FALLBACK_TOKEN_RANGE))
    if not is_gguf(path):
        return token_pool(path)
    from engine.models import load_arch, load_tokenizer

    special = set(load_tokenizer(path).all_special_ids)
    return [t for t in range(load_arch(path).vocab_size) if t not in special]


def random_requests(n: int, input_len: int, output_len: int, pool: list[int], seed: int,
                    kind: str | None = None) -> list[BenchRequest]:
    rng = random.Random(seed)
    label = kind or f"{input_len}x{output_len}"
    return [BenchRequest([rng.choice(pool) for _ in range(input_len)], input_len, output_len,
                         label) for _ in range(n)]


def class_counts(classes: list[MixClass], n: int) -> list[int]:
    """Exact counts summing to n (largest remainder), each class proportional to its weight."""
    total = sum(c.weight for c in classes)
    raw = [c.weight / total * n for c in classes]
    counts = [int(r) for r in raw]
    by_remainder = sorted(range(len(classes)), key=lambda i: raw[i] - counts[i], reverse=True)
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    return counts


def mixed_requests(n: int, classes: list[MixClass], pool: list[int],
                   seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    requests: list[BenchRequest] = []
    for i, (cls, count) in enumerate(zip(classes, class_counts(classes, n), strict=True)):
        requests += random_requests(count, cls.input_len, cls.output_len, pool,
                                    rng.randrange(2**31) + i, cls.label)
    rng.shuffle(requests)
    return requests


def jsonl_requests(path: str, n: int | None, default_output_len: int) -> list[BenchRequest]:
    """The first `n` (all if None) prompts of a JSONL file; errors name the line."""
    requests: list[BenchRequest] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if n is not None and len(requests) >= n:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row["prompt"]
                output_len = int(row.get("output_len", default_output_len))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: expected {{\"prompt\": …, "
                                 f"\"output_len\"?: int}} ({exc})") from None
            if isinstance(prompt, list):
                if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                           for t in prompt):
                    raise ValueError(f"{path}:{lineno}: a token-id prompt must hold ints >= 0")
                prompt_len: int | None = len(prompt)
            elif isinstance(prompt, str):
                prompt_len = None
            else:
                raise ValueError(f"{path}:{lineno}: prompt must be a string or a list of ints")
            try:
                requests.append(BenchRequest(prompt, prompt_len, output_len, "jsonl"))
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from None
    if not requests:
        raise ValueError(f"{path}: no prompts")
    if n is not None and len(requests) < n:
        # cycle so --num-prompts means what it says
        requests = [requests[i % len(requests)] for i in range(n)]
    return requests
