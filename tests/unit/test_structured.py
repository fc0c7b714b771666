"""engine/structured without a server: the API fields map to one grammar (conflicts and bad
values named), the sampler's mask leaves only the grammar's tokens, and a matcher rebuilt
from a request's output tokens (after a preemption, or on D seeded with P's first token)
gives the same next-token mask as one that followed them step by step."""

from __future__ import annotations

import pytest
import torch

from engine.protocol import StructuredOutput
from engine.structured.grammars import GrammarTable, apply_bitmask
from engine.structured.request import structured_output

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}}, "required": ["a"]}


def test_fields_map_to_one_grammar_and_conflicts_are_named() -> None:
    assert structured_output(response_format={"type": "text"}) is None
    assert structured_output(response_format={"type": "json_object"}).kind == "json_object"
    assert structured_output(guided_choice=["a", "b"]) == StructuredOutput("choice", '["a", "b"]')
    assert structured_output(structured_outputs={"regex": "a+"}).kind == "regex"
    with pytest.raises(ValueError, match="^guided_regex conflicts with guided_json"):
        structured_output(guided_json=SCHEMA, guided_regex="a")
    with pytest.raises(ValueError, match="^guided_regex is not a valid regular expression"):
        structured_output(guided_regex="(")
    with pytest.raises(ValueError, match="^response_format.json_schema must be"):
        structured_output(response_format={"type": "json_schema", "json_schema": {}})


def _walk(table: GrammarTable, spec: StructuredOutput, steps: int) -> tuple[list[int], list]:
    """Greedy over random logits under the grammar; the masks seen at each step."""
    gen = torch.Generator().manual_seed(0)
    out: list[int] = []
    masks = []
    for _ in range(steps):
        mask = table.bitmask([("r", spec, out)])
        masks.append(mask.clone())
        logits = apply_bitmask(torch.randn(1, table.vocab_size, generator=gen), mask)
        assert torch.isfinite(logits).sum() >= 1
        out.append(int(logits.argmax()))
    return out, masks


def test_rebuilt_matcher_continues_exactly(tiny_model: str) -> None:
    table = GrammarTable(tiny_model, _vocab(tiny_model))
    spec = StructuredOutput("json", '{"type": "object", "properties": {"a": {"enum": '
                                    '["x", "yy"]}}, "required": ["a"]}')
    tokens, masks = _walk(table, spec, 6)
    for cut in range(1, 6):  # preempted after `cut` tokens (or seeded with the first one)
        table.drop("r")
        assert torch.equal(table.bitmask([("r", spec, tokens[:cut])]), masks[cut])
    assert table.num_rejected_tokens == 0
    table.drop("r")
    allowed = table.bitmask([("r", spec, [])])
    logits = apply_bitmask(torch.zeros(1, table.vocab_size), allowed)
    assert 0 < int(torch.isfinite(logits).sum()) < table.vocab_size  # '{' and little else
    assert table.bitmask([("free", None, [])]) is None  # no constrained row: no mask at all


def _vocab(model: str) -> int:
    import json
    import os

    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)["vocab_size"]
