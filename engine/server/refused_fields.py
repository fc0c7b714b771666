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
    "functions", "function_call", "chat_template",
    "chat_template_kwargs", "documents", "audio", "modalities", "prediction",
    "web_search_options", "echo",
))


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
    messages = data.get("messages") if "functions" in refused else None
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            if isinstance(message, dict) and _asks_something("function_call",
                                                             message.get("function_call")):
                return (f"messages.{i}.function_call", "messages[].function_call (the "
                        "deprecated functions API) is not supported: use tool_calls")
    return None
