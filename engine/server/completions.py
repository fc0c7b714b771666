"""POST /v1/completions: one or a batch of prompts (text or token ids), streaming or not.

Choice index = prompt index * n + sample index (OpenAI's rule for batched prompts).
Streaming sends OpenAI `text_completion` chunks as SSE and ends with `data: [DONE]`; an error
after the first byte is sent as an error event before `[DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.connector_registry import prompt_kv_params
from engine.server.errors import APIError, request_failed_error
from engine.server.logprobs import (
    TokenText,
    check_prompt_logprobs_leg,
    completion_logprobs,
    echoed_prompt_logprobs,
    merge_completion_logprobs,
    vllm_prompt_logprobs,
)
from engine.server.openai_protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
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

CLIENT_CLOSED = 499


def _engine_prompt(p: str | list[int]) -> Any:
    return p if isinstance(p, str) else {"prompt_token_ids": p}


def _engine_prompts(ctx: ServingContext, body: CompletionRequest) -> list[Any]:
    """The batch as engine prompts, each one's tokenization counted: a text is encoded by the
    engine, token ids are given. `prompt_token_ids` (pdserve's, with one text prompt: a proxy
    encoded it once) replaces the encode; the text stays the prompt `echo` returns."""
    prompts = body.prompts()
    if body.prompt_token_ids is not None:
        if len(prompts) != 1 or not isinstance(prompts[0], str):
            raise APIError("prompt_token_ids goes with exactly one text prompt",
                           param="prompt_token_ids")
        given = given_prompt_ids(ctx, body)
        if given is not None:
            return [{"prompt_token_ids": given, "prompt": prompts[0]}]
    for p in prompts:
        count_prompt(ctx, "encoded" if isinstance(p, str) else "given")
    return [_engine_prompt(p) for p in prompts]


def _prompt_text(ctx: ServingContext, out: Any) -> str:
    if out.prompt is not None:
        return out.prompt
    return ctx.tokenizer.decode(out.prompt_token_ids)


def _vllm_prompt_logprobs(body: Any, out: Any, token_text: TokenText) -> Any:
    if body.prompt_logprobs is None:
        return None
    return vllm_prompt_logprobs(out.prompt_logprobs, body.prompt_logprobs, token_text)


def _request_failed(out: Any) -> APIError:
    return request_failed_error(out.request_id, out.error)


async def create_completion(
    body: CompletionRequest, request: Request, ctx: ServingContext
) -> Response:
    ctx.check_model(body.model)
    params = ctx.with_defaults(body, body.to_sampling_params())
    check_prompt_logprobs_leg(params, body.kv_transfer_params, ctx.kv_spec)
    prompts = _engine_prompts(ctx, body)
    rid = make_request_id(request, "cmpl")
    ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    streams = [
        engine_stream(ctx, p, params, i,
                      prompt_kv_params(ctx.kv_spec, body.kv_transfer_params, index,
                                       len(prompts)),
                      body.data_parallel_rank)
        for index, (p, i) in enumerate(zip(prompts, ids, strict=True))
    ]
    merged = merge_streams(streams)
    headers = {"X-Request-Id": rid}
    if body.stream:
        gone, first = await unless_disconnected(request, primed(merged))
        if gone:
            await merged.aclose()
            return Response(status_code=CLIENT_CLOSED)
        item, rest = first
        return SSEResponse(_stream(ctx, body, rid, item, rest), headers=headers,
                           on_close=rest.aclose)
    gone, finals = await unless_disconnected(request, _collect(merged, len(prompts)))
    if gone:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(_response(ctx, body, rid, finals).model_dump(), headers=headers)


async def _collect(merged: AsyncIterator[tuple[int, Any]], count: int) -> list[Any]:
    finals: list[Any] = [None] * count
    async for index, out in merged:
        if finals[index] is None:
            finals[index] = out
        else:
            finals[index].add(out, aggregate=False)
    return finals


def _response(
    ctx: ServingContext, body: CompletionRequest, rid: str, finals: list[Any]
) -> CompletionResponse:
    token_text = TokenText(ctx.tokenizer)
    want_lp = body.logprobs is not None
    choices: list[CompletionChoice] = []
    prompt_tokens = completion_tokens = cached_tokens = 0
    # A batch answers with its first prompt's params (a D leg gives them to its first prompt).
    kv_params = finals[0].kv_transfer_params if finals and finals[0] is not None else None
    for pi, final in enumerate(finals):
        if final is None:
            raise APIError(f"request {rid} ended without output", 500)
        if final.error:
            raise _request_failed(final)
        prompt_tokens += len(final.prompt_token_ids)
        cached_tokens += final.num_cached_tokens
        prefix = _prompt_text(ctx, final) if body.echo else ""
        for comp in final.outputs:
            completion_tokens += len(comp.token_ids)
            lp = None
            if want_lp:
                lp = completion_logprobs(
                    comp.token_ids, comp.logprobs, body.logprobs or 0, token_text, len(prefix)
                )
                if body.echo:
                    lp = merge_completion_logprobs(echoed_prompt_logprobs(
                        final.prompt_token_ids, final.prompt_logprobs, body.logprobs or 0,
                        token_text), lp)
            choices.append(CompletionChoice(
                index=pi * body.n + comp.index, text=prefix + comp.text, logprobs=lp,
                finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
                prompt_logprobs=_vllm_prompt_logprobs(body, final, token_text),
            ))
    choices.sort(key=lambda c: c.index)
    return CompletionResponse(
        id=rid, model=ctx.model_name, choices=choices,
        usage=UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens),
        kv_transfer_params=kv_params,
    )


async def _stream(
    ctx: ServingContext, body: CompletionRequest, rid: str, first: Any,
    rest: AsyncIterator[tuple[int, Any]],
) -> AsyncIterator[str]:
    created = int(time.time())
    token_text = TokenText(ctx.tokenizer)
    want_lp = body.logprobs is not None
    prompt_tokens: dict[int, int] = {}
    generated: dict[int, int] = {}
    offsets: dict[int, int] = {}
    cached: dict[int, int] = {}
    with_ids: set[int] = set()  # choices whose prompt ids were sent (return_token_ids)

    def usage() -> UsageInfo:
        return UsageInfo.of(sum(prompt_tokens.values()), sum(generated.values()),
                            sum(cached.values()))

    def chunks(pi: int, out: Any) -> list[str]:
        if out.error:
            raise _request_failed(out)
        lines = []
        if pi not in prompt_tokens:
            prompt_tokens[pi] = len(out.prompt_token_ids)
        cached[pi] = max(cached.get(pi, 0), out.num_cached_tokens)
        for comp in out.outputs:
            index = pi * body.n + comp.index
            text = comp.text
            lp = prompt_lps = None
            if index not in offsets:
                offsets[index] = 0
                prompt_lps = _vllm_prompt_logprobs(body, out, token_text)
                if body.echo:
                    text = _prompt_text(ctx, out) + text
                    if want_lp:
                        lp = echoed_prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs,
                                                    body.logprobs or 0, token_text)
                        offsets[index] = len(text) - len(comp.text)
            if not text and not comp.token_ids and comp.finish_reason is None:
                continue
            generated[index] = generated.get(index, 0) + len(comp.token_ids)
            if want_lp:
                new = completion_logprobs(comp.token_ids, comp.logprobs, body.logprobs or 0,
                                          token_text, offsets[index])
                lp = new if lp is None else merge_completion_logprobs(lp, new)
            offsets[index] += len(comp.text)
            chunk = CompletionChunk(
                id=rid, created=created, model=ctx.model_name,
                choices=[CompletionChoice(index=index, text=text, logprobs=lp,
                                          finish_reason=comp.finish_reason,
                                          stop_reason=comp.stop_reason,
                                          prompt_logprobs=prompt_lps)],
                usage=usage() if body.continuous_usage else None,
            )
            if body.return_token_ids:
                lines.append(sse_with_ids(chunk, comp.token_ids, None if index in with_ids
                                          else out.prompt_token_ids))
                with_ids.add(index)
            else:
                lines.append(sse(chunk))
        if out.kv_transfer_params is not None:  # a streamed P leg's (proxy/handover.py)
            lines.append(sse({"kv_transfer_params": out.kv_transfer_params}))
        return lines

    try:
        if first is not None:
            for line in chunks(*first):
                yield line
            async for pi, out in rest:
                for line in chunks(pi, out):
                    yield line
        if body.include_usage:
            yield sse(CompletionChunk(id=rid, created=created, model=ctx.model_name,
                                      choices=[], usage=usage()))
    except Exception as exc:  # noqa: BLE001 - reported in-band, the status is already sent
        yield sse_error(exc)
    finally:
        await rest.aclose()
    yield SSE_DONE
