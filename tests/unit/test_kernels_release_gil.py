"""The step's compiled kernels release the GIL while they compute, so the engine core's other
threads (its input and output threads, the connector's transfer thread, the heartbeat) run
Python during a step on another core instead of waiting for the interpreter's switch
interval (5 ms) or the step's end. Played with a second thread that stamps the clock in a
loop: some stamps fall inside a kernel call only if that call let go of the GIL."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from engine import kernels


def _stamps_inside(call) -> bool:
    """Whether a thread that lets go of the GIL after every clock stamp got to stamp while
    `call` ran. The switch interval is raised for the test, so the caller never loses the GIL
    by force: the thread runs during the call only if the call released it."""
    stamps: list[float] = []
    stop = threading.Event()

    def stamp() -> None:
        while not stop.is_set():
            stamps.append(time.monotonic())
            time.sleep(0)  # releases the GIL

    interval = sys.getswitchinterval()
    t = threading.Thread(target=stamp)
    t.start()
    sys.setswitchinterval(1.0)
    try:
        for _ in range(20):  # a loaded machine may not run the thread during one call
            time.sleep(0.001)  # let the thread take its turn before the call
            start = time.monotonic()
            out = call()
            end = time.monotonic()
            del out  # freeing big outputs may release the GIL: outside the window
            # holding the GIL, a call lets one stamp through at most, as it returns
            if sum(start < s < end for s in stamps[-5000:]) >= 10:
                return True
        return False
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        t.join()


@pytest.fixture(scope="module")
def mod():
    m = kernels.compiled()
    assert m is not None, "the compiled CPU kernels did not build"
    return m


def test_skinny_linear_releases_the_gil(mod):
    w = torch.randn(8192, 4096)  # 128 MiB of weights: a call of several ms
    x = torch.randn(4, 4096)
    assert _stamps_inside(lambda: mod.skinny_linear(x, w))


def test_add_rms_norm_releases_the_gil(mod):
    x, res = torch.randn(2048, 4096), torch.randn(2048, 4096)  # 32 MiB each
    w = torch.randn(4096)
    assert _stamps_inside(lambda: mod.add_rms_norm(x, res, w, 1e-6))


def test_the_decode_stack_releases_the_gil(mod):
    from engine.runner.attention import AttentionMetadata, PagedAttention, SeqSpan

    hidden, heads, kv, dim, inter, n = 2048, 16, 4, 128, 4096, 4  # ~100 MiB of weights
    layer = [torch.ones(hidden), torch.randn(heads * dim + 2 * kv * dim, hidden),
             torch.randn(hidden, heads * dim), torch.ones(hidden),
             torch.randn(2 * inter, hidden), torch.randn(hidden, inter)]
    stack = mod.DecodeStack([layer[0]], [layer[1]], [], [layer[2]], [], [layer[3]], [layer[4]],
                            [layer[5]], heads, kv, dim, inter, 1e-6)
    cache = torch.zeros(n, 1, 2, 16, kv, dim)
    spans = [SeqSpan(i, 1, 9, [i]) for i in range(n)]
    attn = PagedAttention(cache, AttentionMetadata(spans, 16, 1, torch.device("cpu"), True),
                          dim ** -0.5, mod)
    cos_sin = torch.randn(n, 1, dim)
    stack.set_step(cos_sin[..., :dim // 2], cos_sin[..., dim // 2:], *attn.decode_only())
    x = torch.randn(n, hidden)
    assert _stamps_inside(lambda: stack.run(x))
