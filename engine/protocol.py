"""Typed messages that cross process boundaries (msgspec structs, msgpack on the wire).

Invariant: everything here is plain data. No struct holds a callable, a tensor that is
not encoded by `engine.serial`, or anything that would need pickle.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


class _StrictFields(type(msgspec.Struct)):
    """Unknown keyword arguments are a ValueError naming them (msgspec says TypeError)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        unknown = sorted(set(kwargs) - set(cls.__struct_fields__))
        if unknown or args:
            names = ", ".join(unknown) or "positional arguments"
            raise ValueError(f"unknown sampling field(s): {names}")
        wrong = [k for k, v in kwargs.items() if not _type_ok(k, v)]
        if wrong:
            raise ValueError(f"{wrong[0]} has the wrong type: {kwargs[wrong[0]]!r}")
        return super().__call__(**kwargs)


_NUMERIC = {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty"}
_INTS = {"n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"}


def _type_ok(name: str, value: Any) -> bool:
    if value is None:
        return name in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "structured")
    if name in _NUMERIC:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if name in _INTS:
        return isinstance(value, int) and not isinstance(value, bool)
    return True


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutput(msgspec.Struct, array_like=True, frozen=True):
    """A grammar the sampled tokens must follow (engine/structured compiles it).

    kind "json": spec is a JSON schema (text); "json_object": any JSON object (spec "");
    "regex": a regular expression; "choice": a JSON list of the allowed strings;
    "grammar": an EBNF grammar (xgrammar's GBNF dialect)."""

    kind: str
    spec: str = ""


class SamplingParams(
    msgspec.Struct, metaclass=_StrictFields, kw_only=True, omit_defaults=True,
    forbid_unknown_fields=True,
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
    # logprob of every prompt token after the first (+ the top-N there), from the prefill
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured: StructuredOutput | None = None  # constrained decoding (None: free text)

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
    _check(
        p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= 20,
        "prompt_logprobs", f"must be in [0, 20], got {p.prompt_logprobs}",
    )
    _check(-2 <= p.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
    _check(-2 <= p.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
    _check(p.repetition_penalty > 0, "repetition_penalty", "must be positive")
    _check(all(isinstance(s, str) and s for s in p.stop), "stop", "must be non-empty strings")
    _check(
        all(isinstance(t, int) and t >= 0 for t in p.stop_token_ids),
        "stop_token_ids", "must be non-negative integers",
    )
    _check(
        p.structured is None or (isinstance(p.structured, StructuredOutput)
                                 and p.structured.kind in STRUCTURED_KINDS),
        "structured", f"must be a StructuredOutput of kind {'/'.join(STRUCTURED_KINDS)}",
    )


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request as the EngineCore sees it: already tokenized and validated."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float = 0.0
    kv_transfer_params: dict[str, Any] | None = None
    data_parallel_rank: int | None = None  # pin to this DP engine (None: the balancer picks)


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
    # with SamplingParams.prompt_logprobs: prompt positions 1..P-1, on the first token's output
    prompt_logprobs: list[Logprobs] | None = None
    # on a request's last output: seconds from arrival to its first schedule (queue metric)
    queued_time: float = 0.0

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
    num_preemptions: int = 0  # cumulative, since the core started


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
