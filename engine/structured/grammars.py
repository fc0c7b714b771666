"""xgrammar where the model runs: compiled grammars (cached) and each request's matcher.

`GrammarTable` is owned by one model runner and used on its thread only. Each step, before
sampling, `bitmask` brings every constrained request's matcher up to the request's output
tokens (the tokens this runner sampled, a first token another engine sampled and this one
was seeded with, or all of them again after a preemption: the matcher is rebuilt from the
tokens, so it never disagrees with them) and fills that row's allowed-token bitmask
(packed int32 [N, ceil(V/32)], -1 = all allowed). `apply_bitmask` masks logits with it.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from engine.protocol import StructuredOutput

logger = logging.getLogger(__name__)

_COMPILERS: dict[tuple[str, int], Any] = {}  # (tokenizer path, vocab) -> GrammarCompiler
_LOCK = threading.Lock()
_CACHE_LIMIT_BYTES = 256 << 20  # compiled grammars kept per tokenizer (least recently used go)


def _compiler(tokenizer_path: str, vocab_size: int) -> Any:
    """One xgrammar compiler per tokenizer in the process; it caches compiled grammars."""
    key = (tokenizer_path, vocab_size)
    with _LOCK:
        if key not in _COMPILERS:
            import xgrammar as xgr

            info = _tokenizer_info(xgr, tokenizer_path, vocab_size)
            # bounded: every distinct schema a client sends would otherwise stay cached
            _COMPILERS[key] = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True,
                                                  cache_limit_bytes=_CACHE_LIMIT_BYTES)
        return _COMPILERS[key]


def _tokenizer_info(xgr: Any, model: str, vocab_size: int) -> Any:
    """xgrammar's view of the engine's own tokenizer (a directory's tokenizer.json or one
    rebuilt from a GGUF file), as its from_huggingface reads a fast tokenizer."""
    from engine.models.formats import load_tokenizer

    tok = load_tokenizer(model)
    backend = tok._tok  # the `tokenizers` Tokenizer
    encoded = [""] * vocab_size
    for token, idx in backend.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size:
            encoded[idx] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    stops = [tok.eos_token_id] if tok.eos_token_id is not None else None
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=stops, add_prefix_space=meta["add_prefix_space"])


def _choice_grammar(spec: str) -> str:
    alternatives = " | ".join(json.dumps(c) for c in json.loads(spec))
    return f"root ::= {alternatives}"


def compile_grammar(tokenizer_path: str, vocab_size: int, spec: StructuredOutput) -> Any:
    """The compiled grammar (from the cache after the first time). ValueError: uncompilable."""
    try:
        c = _compiler(tokenizer_path, vocab_size)
        # compact JSON: free whitespace lets a weak model pad forever and never close
        if spec.kind == "json":
            return c.compile_json_schema(spec.spec, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.spec)
        if spec.kind == "choice":
            return c.compile_grammar(_choice_grammar(spec.spec))
        return c.compile_grammar(spec.spec)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the reason
        raise ValueError(f"structured output ({spec.kind}) cannot be compiled: {exc}") from exc


@dataclass
class _Matched:
    matcher: Any
    accepted: int = 0  # output tokens the matcher has consumed


class GrammarTable:
    def __init__(self, tokenizer_path: str, vocab_size: int) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self._matched: dict[str, _Matched] = {}
        self.num_rejected_tokens = 0  # output tokens a matcher refused (never expected)
        self._pool: Any = None  # one "grammar-mask" thread, started by the first grammar

    def bitmask_async(self, rows: list[tuple[str, StructuredOutput | None, list[int]]]
                      ) -> Future[torch.Tensor | None] | None:
        """`bitmask(rows)` on the grammar-mask thread, so it overlaps the forward pass (the
        rows' tokens are known before it; xgrammar releases the GIL). None: no constrained
        row. The caller takes the result before the next call: one job at a time, so the
        table is never used by two threads at once."""
        if all(spec is None for _, spec, _ in rows):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._pool.submit(self.bitmask, rows)

    def drop(self, req_id: str) -> None:
        self._matched.pop(req_id, None)

    def _matcher(self, req_id: str, spec: StructuredOutput) -> _Matched:
        m = self._matched.get(req_id)
        if m is None:
            import xgrammar as xgr

            grammar = compile_grammar(self.tokenizer_path, self.vocab_size, spec)
            m = self._matched[req_id] = _Matched(xgr.GrammarMatcher(grammar))
        return m

    def _catch_up(self, req_id: str, m: _Matched, outputs: list[int]) -> None:
        for tok in outputs[m.accepted:]:
            if not m.matcher.is_terminated() and not m.matcher.accept_token(tok):
                self.num_rejected_tokens += 1
                logger.warning("request %s: output token %d breaks its grammar", req_id, tok)
        m.accepted = len(outputs)

    def bitmask(self, rows: list[tuple[str, StructuredOutput | None, list[int]]]
                ) -> torch.Tensor | None:
        """rows: (request id, grammar or None, output tokens so far), one per sampled row."""
        if all(spec is None for _, spec, _ in rows):
            return None
        words = (self.vocab_size + 31) // 32
        mask = torch.full((len(rows), words), -1, dtype=torch.int32)
        for i, (req_id, spec, outputs) in enumerate(rows):
            if spec is None:
                continue
            m = self._matcher(req_id, spec)
            self._catch_up(req_id, m, outputs)
            m.matcher.fill_next_token_bitmask(mask, i)
        return mask


_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [N, V] with every token the row's bitmask forbids set to -inf (in place)."""
    n, vocab = logits.shape
    shifts = _SHIFTS.to(bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(n, -1)[:, :vocab].bool()
    return logits.masked_fill_(~allowed.to(logits.device), float("-inf"))
