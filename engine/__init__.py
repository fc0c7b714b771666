"""pdserve's serving engine. Public API: LLM, SamplingParams, AsyncLLM."""

from engine.protocol import RequestOutputKind, SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutputKind"]


def __getattr__(name: str):  # lazy: importing engine must not pull torch for the proxy
    if name == "LLM":
        from engine.frontend.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from engine.frontend.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
