"""Request and response bodies of the OpenAI-compatible API (pydantic).

Requests accept the OpenAI fields plus vLLM's sampling extras (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, ...) and `kv_transfer_params`.
Unknown fields are ignored, as vLLM does, so clients sending newer OpenAI fields still work;
fields we accept but cannot honour (logit_bias, suffix, tools, ...) are a 400 naming them.
Range checks live in `SamplingParams` (one source of truth); its ValueError names the field.
Every body is first judged whole (`body_check`: valid Unicode, bounded nesting), and no
integer or float field takes a JSON `true`/`false` (pydantic's lax mode would read 1/0).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    FiniteFloat,
    StrictInt,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engine.protocol import RequestOutputKind, SamplingParams
from engine.server.body_check import body_problem
from engine.server.errors import APIError, from_value_error
from engine.server.refused_fields import CHAT_REFUSED, COMPLETION_REFUSED, refused_field
from engine.server.tools import history_message
from engine.structured.request import structured_output

_MAX_N = 128


def _not_bool(value: Any) -> Any:
    """JSON true/false is never a number here (`prompt: [true, false]` is not token ids)."""
    if isinstance(value, bool):
        raise PydanticCustomError("bool_not_number", "a boolean is not a number")
    return value


NoBool = BeforeValidator(_not_bool)
# Bounded ints keep every value representable on the msgpack wire (a 10**30 is a 400, not a 500).
Int32 = Annotated[int, NoBool, Field(ge=-(2**31), le=2**31 - 1)]
TokenId = Annotated[int, NoBool, Field(ge=0, le=2**31 - 1)]
StrictTokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]  # "2" and 2.0 are not ids
Seed = Annotated[int, NoBool, Field(ge=-(2**63), le=2**63 - 1)]
Float = Annotated[FiniteFloat, NoBool]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")
    refused_fields: ClassVar[frozenset[str]] = frozenset()  # refused_fields.py: a 400 each

    @model_validator(mode="before")
    @classmethod
    def _admissible(cls, data: Any) -> Any:
        """The whole body, before any field: text that is not valid Unicode or nesting
        past MAX_JSON_DEPTH, or a field we do not implement, is a 400 naming the field
        (errors.py reads the ctx)."""
        problem = body_problem(data) or refused_field(data, cls.refused_fields)
        if problem is not None:
            path, what = problem
            raise PydanticCustomError("inadmissible_body", "{path}: {what}",
                                      {"path": path, "what": what})
        return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Request):
    """Fields shared by both generation routes."""

    model: str | None = None
    n: Int32 = 1
    best_of: Int32 | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int32 | None = None
    min_p: Float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    min_tokens: Int32 = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, Float] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    data_parallel_rank: Int32 | None = None  # pin to this DP engine of the server
    prompt_logprobs: Int32 | None = None  # vLLM's: each prompt token's logprob (+ top-N)
    # structured output (engine/structured/request.py checks and merges them into one)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # vLLM's: streamed chunks carry each choice's new `token_ids` (and the prompt's ids first)
    return_token_ids: bool = False
    # pdserve's: the prompt's token ids as this server would make them (a proxy with
    # --tokenizer renders and encodes once for both legs, proxy/routing.py); given, the server
    # skips the chat template and the encode and uses them (engine/server/serving.py checks)
    prompt_token_ids: list[StrictTokenId] | None = None
    # pdserve's: the fingerprint of the tokenizer that made prompt_token_ids; one that is not
    # this server's own means those ids are not its ids: the server encodes the text itself
    prompt_tokenizer: str | None = None

    def wanted_prompt_logprobs(self) -> int | None:
        """Top-N of the prompt logprobs the engine must compute (None: none)."""
        return self.prompt_logprobs

    def _check_unsupported(self) -> None:
        if self.logit_bias:
            raise APIError("logit_bias is not supported", param="logit_bias")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of must equal n (beam search is not supported)", param="best_of")
        if not 1 <= self.n <= _MAX_N:
            raise APIError(f"n must be in [1, {_MAX_N}], got {self.n}", param="n")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed with stream=true",
                           param="stream_options")

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self._check_unsupported()
        if max_tokens is not None and max_tokens < 1:
            raise APIError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        fields: dict[str, Any] = {
            "n": self.n,
            "seed": self.seed,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "stop": stop,
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "prompt_logprobs": self.wanted_prompt_logprobs(),
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "output_kind": RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        }
        try:
            fields["structured"] = structured_output(
                response_format=self.response_format, structured_outputs=self.structured_outputs,
                guided_json=self.guided_json, guided_regex=self.guided_regex,
                guided_choice=self.guided_choice, guided_grammar=self.guided_grammar)
        except ValueError as exc:  # "response_format.type must be ...": param response_format
            raise APIError(str(exc), param=str(exc).split(" ", 1)[0].split(".")[0]) from exc
        optional = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        fields.update({k: v for k, v in optional.items() if v is not None})
        try:
            return SamplingParams(**fields)
        except ValueError as exc:
            raise from_value_error(exc) from exc

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


PromptInput = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_SamplingFields):
    refused_fields: ClassVar[frozenset[str]] = COMPLETION_REFUSED
    prompt: PromptInput
    max_tokens: Int32 | None = 16
    logprobs: Int32 | None = None
    echo: bool = False
    suffix: str | None = None

    def wanted_prompt_logprobs(self) -> int | None:
        """`echo` with `logprobs` lists the prompt's tokens with their logprobs too."""
        echoed = self.logprobs if self.echo and self.logprobs is not None else None
        if echoed is None or self.prompt_logprobs is None:
            return self.prompt_logprobs if echoed is None else echoed
        return max(echoed, self.prompt_logprobs)

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        return self._sampling(self.max_tokens, self.logprobs)

    def prompts(self) -> list[str | list[int]]:
        """The batch: each entry a text or a token-id list. Empty prompts are a 400."""
        p = self.prompt
        if isinstance(p, str):
            batch: list[Any] = [p]
        elif p and all(isinstance(x, int) for x in p):
            batch = [list(p)]
        else:
            batch = list(p)
        if not batch:
            raise APIError("prompt must not be empty", param="prompt")
        for item in batch:
            if len(item) == 0:
                raise APIError("prompt must not be empty", param="prompt")
            if isinstance(item, list) and any(t < 0 for t in item):
                raise APIError("prompt token ids must be non-negative", param="prompt")
        return batch


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (engine/server/tools)
    tool_call_id: str | None = None  # a tool result's call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    refused_fields: ClassVar[frozenset[str]] = CHAT_REFUSED
    messages: list[ChatMessage]
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def to_sampling_params(self) -> SamplingParams:
        if not self.messages:
            raise APIError("messages must not be empty", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise APIError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}",
                           param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError("continue_final_message and add_generation_prompt exclude each other",
                           param="continue_final_message")
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs)

    def message_dicts(self) -> list[dict[str, Any]]:
        return [history_message(m) for m in self.messages]


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


# ---- responses -------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (or a P engine's KV)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> UsageInfo:
        return cls(prompt_tokens=prompt, completion_tokens=completion,
                   total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob, one entry of a `prompt_logprobs` position (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobsList = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsList | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None
    prompt_logprobs: PromptLogprobsList | None = None


class DeltaMessage(BaseModel):
    """Only the fields a chunk carries are sent (`{"content": "..."}`), as OpenAI does."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pdserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
