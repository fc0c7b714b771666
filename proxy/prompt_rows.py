"""Requests whose answer needs the prompt's own logprobs (vLLM's `prompt_logprobs`, or `echo`
with `logprobs` on completions: lm-eval's loglikelihood). Those come from the prefill's
forward pass (engine/runner/prompt_logprobs.py), which a decode engine that receives the
prompt's KV never runs, so the flow sends such a request to one engine, which prefills it
itself (route reason "prompt_logprobs") instead of splitting it into legs.
"""

from __future__ import annotations

from typing import Any


def wants_prompt_logprobs(body: dict[str, Any]) -> bool:
    if body.get("prompt_logprobs") is not None:
        return True
    return bool(body.get("echo")) and body.get("logprobs") is not None
