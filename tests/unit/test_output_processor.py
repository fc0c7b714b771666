"""OutputProcessor: output kinds, n > 1 aggregation, stop strings, aborts, errors, stats."""

from __future__ import annotations

import asyncio

import pytest

from engine.frontend.output_processor import (
    OutputProcessor,
    ParentRequest,
    RequestOutputCollector,
)
from engine.frontend.outputs import CompletionOutput, RequestOutput
from engine.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    Logprobs,
    RequestOutputKind,
    SamplingParams,
)

EOS = 99
CUM, DELTA = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA
FINAL = RequestOutputKind.FINAL_ONLY


class CharTokenizer:
    """id i < 26 -> letter; 26 -> space; EOS is special ("" when skipped)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            if i == EOS:
                out.append("" if skip_special_tokens else "</s>")
            else:
                out.append(" " if i == 26 else chr(ord("a") + i))
        return "".join(out)


def ids(text: str) -> list[int]:
    return [26 if c == " " else ord(c) - ord("a") for c in text]


def make_req(rid="r-0123abcd", kind=CUM, arrival=0.0, **params) -> EngineCoreRequest:
    params.setdefault("max_tokens", 50)
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(output_kind=kind, **params), EOS,
                             arrival_time=arrival)


def out(rid, text="", finish=None, **kw) -> EngineCoreOutput:
    return EngineCoreOutput(rid, ids(text), finish_reason=finish, **kw)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def proc() -> OutputProcessor:
    return OutputProcessor(CharTokenizer(), log_stats=True)


def test_cumulative_outputs_carry_everything_and_the_external_id(proc):
    proc.add_request(make_req(), "prompt text", external_req_id="r")
    first = proc.process_outputs([out("r-0123abcd", "he")]).request_outputs
    assert len(first) == 1 and first[0].request_id == "r" and not first[0].finished
    assert first[0].prompt == "prompt text" and first[0].prompt_token_ids == [1, 2, 3]
    assert first[0].outputs[0].text == "he" and first[0].outputs[0].finish_reason is None
    last = proc.process_outputs([out("r-0123abcd", "llo", FinishReason.LENGTH)]).request_outputs
    c = last[0].outputs[0]
    assert last[0].finished and c.text == "hello" and c.token_ids == ids("hello")
    assert c.finish_reason == "length" and c.stop_reason is None
    assert first[0].outputs[0].token_ids == ids("he")  # earlier outputs are not mutated
    assert not proc.has_unfinished_requests()


def test_external_id_defaults_to_internal_id_without_suffix(proc):
    proc.add_request(make_req("user-7-deadbeef"), None)
    ro = proc.process_outputs([out("user-7-deadbeef", "a", FinishReason.LENGTH)])
    assert ro.request_outputs[0].request_id == "user-7"


def test_delta_outputs_carry_only_what_is_new(proc):
    proc.add_request(make_req(kind=DELTA), None)
    texts = []
    for chunk, fin in [("ab", None), ("c", None), ("de", FinishReason.LENGTH)]:
        (ro,) = proc.process_outputs([out("r-0123abcd", chunk, fin)]).request_outputs
        texts.append((ro.outputs[0].text, ro.outputs[0].token_ids, ro.finished))
    assert texts == [("ab", ids("ab"), False), ("c", ids("c"), False), ("de", ids("de"), True)]


def test_final_only_outputs_once_at_finish(proc):
    proc.add_request(make_req(kind=FINAL), None)
    assert proc.process_outputs([out("r-0123abcd", "ab")]).request_outputs == []
    (ro,) = proc.process_outputs(
        [out("r-0123abcd", "c", FinishReason.STOP, stop_reason=None)]).request_outputs
    # The core stopped on a stop token: it stays in token_ids but not in the text.
    assert ro.outputs[0].text == "ab" and ro.outputs[0].token_ids == ids("abc")
    assert ro.outputs[0].finish_reason == "stop" and ro.finished


def test_stop_string_finishes_request_and_asks_core_to_abort(proc):
    proc.add_request(make_req(kind=DELTA, stop=["lo w"]), None)
    streamed = []
    r1 = proc.process_outputs([out("r-0123abcd", "hel")])
    streamed += [ro.outputs[0].text for ro in r1.request_outputs]
    r2 = proc.process_outputs([out("r-0123abcd", "lo world")])
    assert r2.reqs_to_abort == ["r-0123abcd"]
    (ro,) = r2.request_outputs
    streamed.append(ro.outputs[0].text)
    c = ro.outputs[0]
    assert "".join(streamed) == "hel" and ro.finished
    assert c.finish_reason == "stop" and c.stop_reason == "lo w"
    # Tokens after the one that completed the stop string are dropped.
    assert c.token_ids == ids("lo w")
    # Late outputs from the core for the aborted request are ignored.
    assert proc.process_outputs([out("r-0123abcd", "x")]).request_outputs == []


def test_stop_string_found_as_core_finishes_is_not_aborted_again(proc):
    proc.add_request(make_req(stop=["yz"]), None)
    res = proc.process_outputs([out("r-0123abcd", "xyz", FinishReason.LENGTH)])
    assert res.reqs_to_abort == []
    c = res.request_outputs[0].outputs[0]
    assert c.text == "x" and c.finish_reason == "stop" and c.stop_reason == "yz"


def test_logprobs_become_position_dicts_aligned_with_tokens(proc):
    proc.add_request(make_req(logprobs=1, stop=["c"]), None)
    lps = [Logprobs([0, 5], [-0.5, -0.1], 2), Logprobs([1, 1], [-0.25, -0.25], 1),
           Logprobs([2, 7], [-1.0, -0.2], 3), Logprobs([3, 3], [-0.1, -0.1], 1)]
    res = proc.process_outputs([EngineCoreOutput("r-0123abcd", [0, 1, 2, 3], new_logprobs=lps)])
    c = res.request_outputs[0].outputs[0]
    assert c.token_ids == [0, 1, 2]  # "abc": stopped at "c"
    assert c.logprobs == [{0: -0.5, 5: -0.1}, {1: -0.25}, {2: -1.0, 7: -0.2}]
    assert c.cumulative_logprob == pytest.approx(-1.75)
    proc.add_request(make_req("q-0123abcd"), None)
    c2 = proc.process_outputs([out("q-0123abcd", "a")]).request_outputs[0].outputs[0]
    assert c2.logprobs is None and c2.cumulative_logprob is None


def test_engine_error_sets_error_and_finish_reason(proc):
    proc.add_request(make_req(), None)
    (ro,) = proc.process_outputs([EngineCoreOutput(
        "r-0123abcd", [], finish_reason=FinishReason.ERROR, error="KV load failed from P"
    )]).request_outputs
    assert ro.finished and ro.error == "KV load failed from P"
    assert ro.outputs[0].finish_reason == "error"


def _parent(kind, n=3, seed=None):
    req = make_req("p-0123abcd", kind=kind, n=n, seed=seed)
    return req, ParentRequest(req, external_req_id="p")


def test_fan_out_gives_n_children_with_ids_and_seeds():
    req, parent = _parent(CUM, n=3, seed=7)
    children = parent.fan_out()
    assert [c.request_id for c in children] == ["0_p-0123abcd", "1_p-0123abcd", "2_p-0123abcd"]
    assert [c.sampling_params.seed for c in children] == [7, 8, 9]
    assert all(c.sampling_params.n == 1 for c in children)
    assert all(c.prompt_token_ids == req.prompt_token_ids for c in children)
    assert req.sampling_params.n == 3  # the parent's params are untouched
    _, unseeded = _parent(CUM, n=2)
    assert [c.sampling_params.seed for c in unseeded.fan_out()] == [None, None]


def _add_children(proc, parent, queue=None):
    for i, child in enumerate(parent.fan_out()):
        proc.add_request(child, "p?", parent, i, queue=queue, external_req_id="p")


def test_final_only_parent_aggregates_all_children_once_sorted(proc):
    _, parent = _parent(FINAL)
    _add_children(proc, parent)
    r = proc.process_outputs([out("2_p-0123abcd", "cc", FinishReason.LENGTH),
                              out("0_p-0123abcd", "a")])
    assert r.request_outputs == []
    r = proc.process_outputs([out("0_p-0123abcd", "a", FinishReason.LENGTH)])
    assert r.request_outputs == []
    (ro,) = proc.process_outputs([out("1_p-0123abcd", "b", FinishReason.LENGTH)]).request_outputs
    assert ro.request_id == "p" and ro.finished
    assert [(c.index, c.text) for c in ro.outputs] == [(0, "aa"), (1, "b"), (2, "cc")]
    assert not proc.has_unfinished_requests() and not proc.parent_requests


def test_cumulative_parent_reports_all_children_per_update(proc):
    _, parent = _parent(CUM, n=2)
    _add_children(proc, parent)
    (ro,) = proc.process_outputs([out("1_p-0123abcd", "x")]).request_outputs
    assert [(c.index, c.text) for c in ro.outputs] == [(1, "x")]
    (ro,) = proc.process_outputs([out("0_p-0123abcd", "a"),
                                  out("1_p-0123abcd", "y", FinishReason.LENGTH)]).request_outputs
    assert [(c.index, c.text) for c in ro.outputs] == [(0, "a"), (1, "xy")] and not ro.finished
    (ro,) = proc.process_outputs([out("0_p-0123abcd", "b", FinishReason.LENGTH)]).request_outputs
    assert [(c.index, c.text) for c in ro.outputs] == [(0, "ab"), (1, "xy")] and ro.finished


def test_delta_parent_sends_one_output_per_pass(proc):
    _, parent = _parent(DELTA, n=2)
    _add_children(proc, parent)
    (ro,) = proc.process_outputs([out("0_p-0123abcd", "a"), out("1_p-0123abcd", "x")]) \
        .request_outputs
    assert [(c.index, c.text) for c in ro.outputs] == [(0, "a"), (1, "x")]
    (ro,) = proc.process_outputs([out("1_p-0123abcd", "y", FinishReason.LENGTH)]).request_outputs
    assert [(c.index, c.text, c.finish_reason) for c in ro.outputs] == [(1, "y", "length")]
    assert not ro.finished


def test_abort_parent_id_expands_to_children_and_ends_waiter(proc):
    _, parent = _parent(FINAL, n=2)
    q = RequestOutputCollector(FINAL, "p")
    _add_children(proc, parent, queue=q)
    proc.process_outputs([out("0_p-0123abcd", "a", FinishReason.LENGTH)])
    to_abort = proc.abort_requests(["p-0123abcd"])
    assert to_abort == ["1_p-0123abcd"]
    ro = q.get_nowait()
    assert ro.finished and [c.finish_reason for c in ro.outputs] == ["length", "abort"]
    assert not proc.has_unfinished_requests()


def test_abort_single_request_returns_internal_id(proc):
    proc.add_request(make_req(), None)
    assert proc.abort_requests(["r-0123abcd"]) == ["r-0123abcd"]
    assert proc.get_num_unfinished_requests() == 0


def test_collector_merges_deltas_when_consumer_lags():
    q = RequestOutputCollector(DELTA, "r")

    def ro(text, tok, fin=None, idx=0):
        return RequestOutput("r", None, [1], [CompletionOutput(idx, text, tok, None,
                                                               [{tok[0]: -1.0}], fin)],
                             finished=fin is not None)

    q.put(ro("a", [0]))
    q.put(ro("b", [1], idx=1))
    q.put(ro("c", [2]))
    q.put(ro("d", [3], "length"))
    got = q.get_nowait()
    assert [(c.index, c.text, c.token_ids, c.logprobs) for c in got.outputs] == [
        (0, "acd", [0, 2, 3], [{0: -1.0}, {2: -1.0}, {3: -1.0}]), (1, "b", [1], [{1: -1.0}])]
    assert got.finished and got.outputs[0].finish_reason == "length"
    assert q.get_nowait() is None


def test_collector_replaces_cumulative_and_raises_errors():
    async def main():
        q = RequestOutputCollector(CUM, "r")
        q.put(RequestOutput("r", None, [1], [CompletionOutput(0, "a", [0])], False))
        q.put(RequestOutput("r", None, [1], [CompletionOutput(0, "ab", [0, 1])], False))
        assert (await q.get()).outputs[0].text == "ab"
        waiter = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        assert not waiter.done()
        q.put(RuntimeError("engine dead"))
        q.put(RequestOutput("r", None, [1], [CompletionOutput(0, "abc", [0])], False))
        with pytest.raises(RuntimeError, match="engine dead"):
            await waiter

    asyncio.run(main())


def test_propagate_error_reaches_every_queue(proc):
    async def main():
        qs = [RequestOutputCollector(CUM, f"r{i}") for i in range(2)]
        for i, q in enumerate(qs):
            proc.add_request(make_req(f"r{i}-0123abcd"), None, queue=q)
        proc.propagate_error(ConnectionError("EngineCore died"))
        for q in qs:
            with pytest.raises(ConnectionError):
                await q.get()
        assert not proc.has_unfinished_requests()

    asyncio.run(main())


def test_queue_requests_are_not_returned_in_the_list(proc):
    q = RequestOutputCollector(CUM, "r")
    proc.add_request(make_req(), None, queue=q)
    assert proc.process_outputs([out("r-0123abcd", "a")]).request_outputs == []
    assert q.get_nowait().outputs[0].text == "a"


def test_iteration_stats_measure_ttft_itl_and_e2e():
    clock = Clock()
    proc = OutputProcessor(CharTokenizer(), log_stats=True, clock=clock)
    proc.add_request(make_req(arrival=1.0), None)
    _, parent = _parent(CUM, n=2)
    _add_children(proc, parent)  # arrival 0.0, prompt counted once for both children
    clock.t = 1.5
    s = proc.process_outputs([out("r-0123abcd", "ab"), out("0_p-0123abcd", "a"),
                              out("1_p-0123abcd", "b")]).iteration_stats
    assert s.num_prompt_tokens == 3 + 3 and s.num_generation_tokens == 4
    assert sorted(s.time_to_first_tokens_iter) == [0.5, 1.5, 1.5]
    clock.t = 1.75
    s = proc.process_outputs([out("r-0123abcd", "c", FinishReason.LENGTH)]).iteration_stats
    assert s.num_prompt_tokens == 0 and s.inter_token_latencies_iter == [0.25]
    assert s.num_finished == 1 and s.e2e_latencies == [0.75]
    f = s.finished_requests[0]
    assert (f.finish_reason, f.num_generation_tokens, f.first_token_latency) == ("length", 3, 0.5)
    assert OutputProcessor(CharTokenizer(), log_stats=False).process_outputs([]) \
        .iteration_stats is None


def test_abort_by_external_id_and_unknown_ids_pass_through(proc):
    q = RequestOutputCollector(DELTA, "user-9")
    proc.add_request(make_req("user-9-0123abcd", kind=DELTA), None, queue=q,
                     external_req_id="user-9")
    proc.process_outputs([out("user-9-0123abcd", "ab")])
    assert proc.abort_requests(["user-9", "gone-0123abcd"]) == ["user-9-0123abcd",
                                                                "gone-0123abcd"]
    ro = q.get_nowait()  # the pending delta and the abort merged into one output
    assert ro.finished and ro.outputs[0].text == "ab" and ro.outputs[0].finish_reason == "abort"
    assert not proc.external_req_ids and not proc.has_unfinished_requests()


def test_delta_stream_with_real_tokenizer_never_splits_characters(tiny_model):
    from engine.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model)
    text = "数据并行 🚀🔥 café 東京 👩‍💻 done"
    token_ids = tok.encode(text, add_special_tokens=False)
    proc = OutputProcessor(tok)
    req = EngineCoreRequest("s-0123abcd", tok.encode("Hi"),
                            SamplingParams(output_kind=DELTA, max_tokens=99, stop=["done"]),
                            tok.eos_token_id)
    proc.add_request(req, "Hi")
    pieces, results = [], []
    for t in token_ids:
        res = proc.process_outputs([EngineCoreOutput("s-0123abcd", [t])])
        results.append(res)
        pieces += [ro.outputs[0].text for ro in res.request_outputs]
        if res.reqs_to_abort:
            break
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "数据并行 🚀🔥 café 東京 👩‍💻 "
    assert results[-1].reqs_to_abort == ["s-0123abcd"]


def test_kv_transfer_params_and_cached_tokens_reach_the_final_output(proc):
    proc.add_request(make_req(kind=FINAL), None)
    kv = {"do_remote_decode": True, "transfer_id": "t-9", "remote_block_ids": [1, 2]}
    proc.process_outputs([out("r-0123abcd", "a", num_cached_tokens=16,
                              kv_transfer_params=kv)])
    (ro,) = proc.process_outputs([out("r-0123abcd", "b", FinishReason.LENGTH)]).request_outputs
    assert ro.kv_transfer_params == kv and ro.num_cached_tokens == 16
