"""POST /v1/chat/completions: messages → the model's chat template → one generation.

The prompt is rendered with the tokenizer's chat template and tokenized here, so a template
that already starts with the BOS token does not get a second one; a request carrying
`prompt_token_ids` (a proxy rendered them with `prompt_ids_for`, this same path) skips both.
Streaming sends, per choice, a role chunk, content deltas, and a final chunk with
`finish_reason`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.server.completions import CLIENT_CLOSED
from engine.server.errors import APIError, request_failed_error
from engine.server.logprobs import (
    TokenText,
    chat_logprobs,
    check_prompt_logprobs_leg,
    vllm_prompt_logprobs,
)
from engine.server.openai_protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from engine.server.serving import (
    SSE_DONE,
    ServingContext,
    SSEResponse,
    count_prompt,
    engine_stream,
    given_prompt_ids,
    make_request_id,
    merge_streams,
    primed,
    sse,
    sse_error,
    sse_with_ids,
    unless_disconnected,
)
from engine.server.tools import ToolPlan, ToolStream, answer, tool_plan, with_tool_grammar


def render_chat_prompt(
    tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
    continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
    release_gil: bool = False,
) -> dict[str, Any]:
    """The engine prompt (`prompt_token_ids` + `prompt`) for a conversation. `release_gil`:
    encode through the batch call, which lets other threads run meanwhile (same ids)."""
    try:
        extra = {} if tools is None else {"tools": tools}
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             **extra)
    except Exception as exc:  # template errors are about the messages the client sent
        raise APIError(f"messages could not be rendered with the chat template: {exc}",
                       param="messages") from exc
    if continue_final_message and messages:
        last = messages[-1]["content"]
        cut = text.rfind(last)
        if last and cut >= 0:
            text = text[: cut + len(last)]
    bos = getattr(tokenizer, "bos_token", None)
    has_bos = isinstance(bos, str) and bool(bos) and text.startswith(bos)
    if release_gil and hasattr(tokenizer, "encode_batch"):
        ids = list(tokenizer.encode_batch([text], add_special_tokens=not has_bos)[0])
    else:
        ids = list(tokenizer.encode(text, add_special_tokens=not has_bos))
    if not ids:
        raise APIError("messages render to an empty prompt", param="messages")
    return {"prompt_token_ids": ids, "prompt": text}


def request_prompt(tokenizer: Any, body: ChatCompletionRequest, plan: ToolPlan | None,
                   *, release_gil: bool = False) -> dict[str, Any]:
    """A chat request's prompt as this server renders it (the template over its messages with
    the request's add_generation_prompt, continue_final_message and tools)."""
    return render_chat_prompt(
        tokenizer, body.message_dicts(), add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        tools=None if plan is None else plan.tools, release_gil=release_gil,
    )


# tool_choice auto needs the server's parser to answer; the prompt does not depend on it
_ANY_PARSER = "hermes"


def prompt_ids_for(tokenizer: Any, raw: dict[str, Any], *, release_gil: bool = False
                   ) -> list[int]:
    """The prompt token ids a server with `tokenizer` gives the chat request `raw` (its JSON
    body): the same parse and `request_prompt` the route runs, for a proxy that tokenizes once
    and sends them as `prompt_token_ids`. Raises whatever the route would refuse."""
    body = ChatCompletionRequest.model_validate(raw)
    plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, _ANY_PARSER)
    prompt = request_prompt(tokenizer, body, plan, release_gil=release_gil)
    return list(prompt["prompt_token_ids"])


async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, ctx: ServingContext
) -> Response:
    ctx.check_model(body.model)
    plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, ctx.tool_call_parser)
    params = with_tool_grammar(ctx.with_defaults(body, body.to_sampling_params()), plan)
    check_prompt_logprobs_leg(params, body.kv_transfer_params, ctx.kv_spec)
    given = given_prompt_ids(ctx, body)
    if given is not None:  # rendered and encoded once, by the proxy
        prompt: dict[str, Any] = {"prompt_token_ids": given}
    else:
        prompt = request_prompt(ctx.tokenizer, body, plan)
        count_prompt(ctx, "encoded")
    rid = make_request_id(request, "chatcmpl")
    merged = merge_streams([engine_stream(ctx, prompt, params, rid, body.kv_transfer_params,
                                                body.data_parallel_rank)])
    headers = {"X-Request-Id": rid}
    if body.stream:
        gone, first = await unless_disconnected(request, primed(merged))
        if gone:
            await merged.aclose()
            return Response(status_code=CLIENT_CLOSED)
        item, rest = first
        return SSEResponse(_stream(ctx, body, rid, item, rest, plan), headers=headers,
                           on_close=rest.aclose)

    async def collect() -> Any:
        final = None
        async for _, out in merged:
            if final is None:
                final = out
            else:
                final.add(out, aggregate=False)
        return final

    gone, final = await unless_disconnected(request, collect())
    if gone:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(_response(ctx, body, rid, final, plan).model_dump(), headers=headers)


def _top_n(body: ChatCompletionRequest) -> int:
    return body.top_logprobs or 0


def _response(
    ctx: ServingContext, body: ChatCompletionRequest, rid: str, final: Any,
    plan: ToolPlan | None = None,
) -> ChatCompletionResponse:
    if final is None:
        raise APIError(f"request {rid} ended without output", 500)
    if final.error:
        raise request_failed_error(final.request_id, final.error)
    token_text = TokenText(ctx.tokenizer)
    choices = []
    completion_tokens = 0
    for comp in final.outputs:
        completion_tokens += len(comp.token_ids)
        lp = None
        if body.logprobs:
            lp = chat_logprobs(comp.token_ids, comp.logprobs, _top_n(body), token_text)
        content, calls, finish = answer(plan, comp.text, comp.finish_reason)
        choices.append(ChatChoice(
            index=comp.index, message=ChatResponseMessage(content=content, tool_calls=calls),
            logprobs=lp, finish_reason=finish, stop_reason=comp.stop_reason,
        ))
    choices.sort(key=lambda c: c.index)
    prompt_tokens = len(final.prompt_token_ids)
    return ChatCompletionResponse(
        id=rid, model=ctx.model_name, choices=choices,
        usage=UsageInfo.of(prompt_tokens, completion_tokens, final.num_cached_tokens),
        kv_transfer_params=final.kv_transfer_params,
        prompt_logprobs=(None if body.prompt_logprobs is None else vllm_prompt_logprobs(
            final.prompt_logprobs, body.prompt_logprobs, token_text)),
    )


async def _stream(
    ctx: ServingContext, body: ChatCompletionRequest, rid: str, first: Any,
    rest: AsyncIterator[tuple[int, Any]], plan: ToolPlan | None = None,
) -> AsyncIterator[str]:
    created = int(time.time())
    tools = ToolStream(plan) if plan is not None and plan.parses else None
    token_text = TokenText(ctx.tokenizer)
    state = {"prompt_tokens": 0, "cached": 0}
    generated: dict[int, int] = {}

    def usage() -> UsageInfo:
        return UsageInfo.of(state["prompt_tokens"], sum(generated.values()), state["cached"])

    def chunk(choice: ChatStreamChoice, token_ids: Any = (), prompt_ids: Any = None) -> str:
        payload = ChatCompletionChunk(
            id=rid, created=created, model=ctx.model_name, choices=[choice],
            usage=usage() if body.continuous_usage else None,
        )
        if body.return_token_ids:
            return sse_with_ids(payload, token_ids, prompt_ids, prompt_on_choice=False)
        return sse(payload)

    def chunks(out: Any) -> list[str]:
        if out.error:
            raise request_failed_error(out.request_id, out.error)
        state["prompt_tokens"] = len(out.prompt_token_ids)
        state["cached"] = max(state["cached"], out.num_cached_tokens)
        lines = []
        for comp in out.outputs:
            if comp.index not in generated:
                generated[comp.index] = 0
                lines.append(chunk(ChatStreamChoice(
                    index=comp.index, delta=DeltaMessage(role="assistant", content="")),
                    prompt_ids=out.prompt_token_ids))
            if not comp.text and not comp.token_ids and comp.finish_reason is None:
                continue
            generated[comp.index] += len(comp.token_ids)
            lp = None
            if body.logprobs and comp.token_ids:
                lp = chat_logprobs(comp.token_ids, comp.logprobs, _top_n(body), token_text)
            if tools is not None:  # tool calls: held, then sent as OpenAI sends them
                deltas, finish = tools.deltas(comp.index, comp.text, comp.finish_reason)
                deltas = deltas or [{}]
                for j, delta in enumerate(deltas):
                    last = j == len(deltas) - 1
                    lines.append(chunk(ChatStreamChoice(
                        index=comp.index, delta=DeltaMessage(**delta),
                        logprobs=lp if j == 0 else None, finish_reason=finish if last else None,
                        stop_reason=comp.stop_reason if last else None,
                    ), comp.token_ids if j == 0 else ()))
                continue
            lines.append(chunk(ChatStreamChoice(
                index=comp.index,
                delta=DeltaMessage(content=comp.text) if comp.text else DeltaMessage(),
                logprobs=lp, finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
            ), comp.token_ids))
        if out.kv_transfer_params is not None:  # a streamed P leg's (proxy/handover.py)
            lines.append(sse({"kv_transfer_params": out.kv_transfer_params}))
        return lines

    try:
        if first is not None:
            for line in chunks(first[1]):
                yield line
            async for _, out in rest:
                for line in chunks(out):
                    yield line
        if body.include_usage:
            yield sse(ChatCompletionChunk(id=rid, created=created, model=ctx.model_name,
                                          choices=[], usage=usage()))
    except Exception as exc:  # noqa: BLE001 - reported in-band, the status is already sent
        yield sse_error(exc)
    finally:
        await rest.aclose()
    yield SSE_DONE
