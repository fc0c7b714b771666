"""Tokenizer over the `tokenizers` library, read from a Hugging Face model directory.

Format-neutral past `from_dir`: a GGUF file's tokenizer is rebuilt by engine/models/
gguf_tokenizer.py into this same class, and engine/models/formats.py `load_tokenizer` picks the
reader for a MODEL argument.

Reproduces what `transformers.AutoTokenizer` does for tokenizer.json-based models without
importing transformers: special tokens from tokenizer_config.json, BOS/EOS insertion
(`add_bos_token` / `add_eos_token` rebuild the post-processor when given explicitly; otherwise
tokenizer.json's own post-processor decides), and chat templates rendered in a sandboxed jinja2
environment with the same options and helpers. Thread-safe for concurrent encode/decode.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import processors

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_str(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _load_chat_template(model_dir: str, cfg: dict[str, Any]) -> str | None:
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = cfg.get("chat_template") or _read_json(
        os.path.join(model_dir, "chat_template.json")).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}], "default" wins
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser):  # noqa: ANN001, ANN201 - jinja2 extension protocol
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:  # noqa: ANN001
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """Encode/decode/chat-template for one model; see module docstring for the HF parity rules."""

    def __init__(self, backend: _HFTokenizer, config: dict[str, Any],
                 chat_template: str | None = None) -> None:
        self._tok = backend
        self._config = config
        self.chat_template = chat_template
        self.special_tokens: dict[str, str | None] = {
            k: _token_str(config.get(k)) for k in _SPECIAL_KEYS}
        self.bos_token = self.special_tokens["bos_token"]
        self.eos_token = self.special_tokens["eos_token"]
        self.pad_token = self.special_tokens["pad_token"]
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        self.pad_token_id = self._id_of(self.pad_token)
        self.unk_token_id = self._id_of(self.special_tokens["unk_token"])
        explicit = "add_bos_token" in config or "add_eos_token" in config
        if explicit or backend.post_processor is None:
            self._install_post_processor(bool(config.get("add_bos_token")),
                                         bool(config.get("add_eos_token")))

    @classmethod
    def from_dir(cls, model_dir: str) -> Tokenizer:
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"{model_dir!r} has no tokenizer.json")
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        return cls(_HFTokenizer.from_file(path), config, _load_chat_template(model_dir, config))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _install_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        add_bos = add_bos and self.bos_token_id is not None
        add_eos = add_eos and self.eos_token_id is not None
        bos = f"{self.bos_token}:0 " if add_bos else ""
        eos = f" {self.eos_token}:0" if add_eos else ""
        bos1 = f" {self.bos_token}:1" if add_bos else ""
        eos1 = f" {self.eos_token}:1" if add_eos else ""
        specials = ([(self.bos_token, self.bos_token_id)] if add_bos else []) + (
            [(self.eos_token, self.eos_token_id)] if add_eos else [])
        self._tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}$A:0{eos}", pair=f"{bos}$A:0{eos}{bos1} $B:1{eos1}",
            special_tokens=specials)

    # -- encode / decode -------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True
                     ) -> list[list[int]]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encs]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        """Raw vocabulary strings (byte-level symbols, not text); None for unknown ids."""
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._tok.token_to_id(tokens)
        return [self._tok.token_to_id(t) for t in tokens]

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included (HF's len(tok))."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @cached_property
    def all_special_ids(self) -> list[int]:
        """Ids of the named special tokens plus every added token flagged special."""
        ids = {i for i in (self.bos_token_id, self.eos_token_id, self.unk_token_id,
                           self.pad_token_id) if i is not None}
        ids.update(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        return sorted(ids)

    # -- chat ------------------------------------------------------------------------------

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError("this model has no chat template (tokenizer_config.json has no "
                             "chat_template and there is no chat_template.jinja)")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` with the model's chat template (extra kwargs reach the template).

        Raises ValueError if the model has no template or the template rejects the input.
        """
        template = self._compiled_template
        context = {k: v for k, v in self.special_tokens.items() if v is not None}
        context.update(kwargs)
        try:
            return template.render(messages=messages,
                                   add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e
