"""Request fields of the OpenAI and vLLM schemas that pdserve does not implement.

Unknown fields are ignored (a client sending a newer, harmless field still works), but a
field that would change the answer if honoured must never be silently dropped: a 200 with
unconstrained text where the client asked for JSON is worse than a 400. Each entry here is
refused with a 400 naming it, unless its value is one that asks for nothing (null, an empty
list or object, or a listed neutral value). A field leaves this table when it is implemented.
"""

from __future__ import annotations

from typing import Any

# field -> values that ask for nothing (besides None / empty) and so may pass
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tool_choice": ("none",),
    "parallel_tool_calls": (True, False),  # meaningless without tools, which are refused
    "guided_decoding_backend": ("xgrammar", "auto"),  # the one we run
    "use_beam_search": (False,),
    "echo": (False,),
}

# Fields of both generation routes (vLLM's sampling and structured-output extras).
_COMMON = (
    "guided_decoding_backend", "guided_whitespace_pattern", "allowed_token_ids", "bad_words",
    "logits_processors",
    "use_beam_search", "length_penalty", "truncate_prompt_tokens", "vllm_xargs",
    "return_tokens_as_token_ids",
)
COMPLETION_REFUSED = frozenset(_COMMON)
CHAT_REFUSED = frozenset(_COMMON + (
    "tools", "tool_choice", "functions", "function_call", "chat_template",
    "chat_template_kwargs", "documents", "audio", "modalities", "prediction",
    "web_search_options", "echo",
))
# Fields of one chat message that carry tool traffic (role "tool" is checked apart).
_MESSAGE_REFUSED = ("tool_calls", "tool_call_id", "function_call")


def _asks_something(name: str, value: Any) -> bool:
    if value is None or value == [] or value == {}:
        return False
    return value not in _NEUTRAL.get(name, ())


def refused_field(data: Any, refused: frozenset[str]) -> tuple[str, str] | None:
    """(path, why) of the first field of `data` (a raw request body) that is refused."""
    if not isinstance(data, dict) or not refused:
        return None
    for name in sorted(refused & data.keys()):
        if _asks_something(name, data[name]):
            return name, f"{name} is not supported by this server"
    messages = data.get("messages") if "tools" in refused else None
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                continue
            if message.get("role") == "tool":
                return f"messages.{i}.role", "role 'tool' messages are not supported"
            for name in _MESSAGE_REFUSED:
                if _asks_something(name, message.get(name)):
                    return f"messages.{i}.{name}", f"messages[].{name} is not supported"
    return None
