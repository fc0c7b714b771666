"""Nothing silently ignored (issue 31): every OpenAI/vLLM request field the server does not
implement is refused naming it, field by field, on both generation routes; the values that
ask for nothing (null, [], {}, tool_choice "none", response_format text) still pass."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engine.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from engine.server.refused_fields import CHAT_REFUSED, COMPLETION_REFUSED

USER = [{"role": "user", "content": "hi"}]
ASKING = {
    "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["a", "b"],
    "guided_grammar": "root ::= \"a\"", "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " ", "structured_outputs": {"json": {"type": "object"}},
    "response_format": {"type": "json_object"}, "allowed_token_ids": [1, 2],
    "bad_words": ["x"], "logits_processors": ["x"], "use_beam_search": True,
    "length_penalty": 2.0, "truncate_prompt_tokens": 5, "vllm_xargs": {"a": 1},
    "return_tokens_as_token_ids": True,
    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
    "functions": [{"name": "f"}], "function_call": "auto", "chat_template": "{{ 1 }}",
    "chat_template_kwargs": {"enable_thinking": False}, "documents": [{"text": "x"}],
    "audio": {"voice": "x"}, "modalities": ["audio"], "prediction": {"type": "content"},
    "web_search_options": {"a": 1}, "echo": True,
}


def _refusal(model: type, body: dict) -> str:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    err = info.value.errors()[0]
    assert err["type"] == "inadmissible_body"
    return err["ctx"]["path"]


@pytest.mark.parametrize("field", sorted(CHAT_REFUSED))
def test_chat_field_we_do_not_implement_is_refused_naming_it(field: str) -> None:
    assert _refusal(ChatCompletionRequest, {"messages": USER, field: ASKING[field]}) == field


@pytest.mark.parametrize("field", sorted(COMPLETION_REFUSED))
def test_completion_field_we_do_not_implement_is_refused_naming_it(field: str) -> None:
    assert _refusal(CompletionRequest, {"prompt": "hi", field: ASKING[field]}) == field


def test_the_deprecated_function_call_in_the_history_is_refused_naming_it() -> None:
    message = {"role": "assistant", "content": "x", "function_call": {"name": "f"}}
    path = _refusal(ChatCompletionRequest, {"messages": USER + [message]})
    assert path == "messages.1.function_call"


@pytest.mark.parametrize("extra", [
    {"tool_choice": "none"}, {"tools": []}, {"response_format": {"type": "text"}},
    {"guided_json": None}, {"chat_template_kwargs": {}}, {"parallel_tool_calls": True},
    {"use_beam_search": False},
])
def test_values_that_ask_for_nothing_pass(extra: dict) -> None:
    ChatCompletionRequest.model_validate({"messages": USER, **extra})
