"""GET /tokenizer_info: what vLLM's endpoint of that name serves, so a client can tokenize
and render chats as the server does (lm-eval's `tokenizer_backend=remote` reads the special
tokens and the chat template here, then calls /tokenize and /detokenize)."""

from __future__ import annotations

from typing import Any


def tokenizer_info(tokenizer: Any, max_model_len: int) -> dict[str, Any]:
    """The tokenizer's configuration as JSON: its tokenizer_config.json fields that are plain
    data, overlaid with the values the server really uses (special tokens, chat template,
    vocabulary size, context length)."""
    config = getattr(tokenizer, "_config", None) or {}
    info: dict[str, Any] = {k: v for k, v in config.items()
                            if k != "added_tokens_decoder" and _plain(v)}
    specials = getattr(tokenizer, "special_tokens", {}) or {}
    info.update({k: v for k, v in specials.items()})
    info.update(
        tokenizer_class=config.get("tokenizer_class") or type(tokenizer).__name__,
        chat_template=getattr(tokenizer, "chat_template", None),
        bos_token_id=getattr(tokenizer, "bos_token_id", None),
        eos_token_id=getattr(tokenizer, "eos_token_id", None),
        pad_token_id=getattr(tokenizer, "pad_token_id", None),
        vocab_size=len(tokenizer),
        model_max_length=max_model_len,
    )
    return info


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False
