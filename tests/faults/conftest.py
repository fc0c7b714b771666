"""Fault tests: a greedy reference shared by every module; the soak runs last of all tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fault_kit import MAX_TOKENS

from engine import LLM, SamplingParams


@pytest.fixture(scope="session")
def reference(tiny_model: str) -> Callable[..., list[str]]:
    """`reference(prompts, max_tokens)` -> the colocated engine's greedy texts."""
    from engine.models.tokenizer import Tokenizer

    llm = LLM(tiny_model, num_kv_blocks=1024, max_model_len=1024, multiprocess=False)
    tok = Tokenizer.from_dir(tiny_model)

    def run(prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[str]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [tok.decode(list(o.outputs[0].token_ids)) for o in outs]

    yield run
    llm.shutdown()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The soak is the longest test: run it after everything else in the session."""
    soak = [i for i in items if i.path.name == "test_soak.py"]
    if soak:
        rest = [i for i in items if i.path.name != "test_soak.py"]
        items[:] = rest + soak
