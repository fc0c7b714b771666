"""Sampler behaviour: greedy, support restriction, penalties, min_tokens, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.protocol import SamplingParams
from engine.runner.sampler import Sampler, build_sampling_metadata

V = 64


def _meta(params, prompts=None, outputs=None, gens=None, eos=None):
    n = len(params)
    return build_sampling_metadata(
        params,
        prompts if prompts is not None else [[1, 2, 3]] * n,
        outputs if outputs is not None else [[]] * n,
        gens if gens is not None else [None] * n,
        eos if eos is not None else [None] * n,
    )


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _draw(logits_row: torch.Tensor, params: SamplingParams, times: int, seed: int = 0):
    """Sample `times` tokens from one row (batched as `times` identical rows)."""
    torch.manual_seed(seed)
    logits = logits_row.unsqueeze(0).repeat(times, 1)
    out = Sampler()(logits, _meta([params] * times))
    return set(out.sampled_token_ids.tolist())


def test_greedy_is_argmax_of_raw_logits_on_the_fast_path():
    torch.manual_seed(0)
    logits = torch.randn(5, V)
    meta = _meta([SamplingParams(temperature=0.0)] * 5)
    assert meta.all_greedy and meta.no_penalties
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5


def test_sampler_does_not_modify_caller_logits():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05,
                             repetition_penalty=1.3, presence_penalty=0.5)] * 3
    Sampler()(logits, _meta(params, outputs=[[1, 2]] * 3))
    assert torch.equal(logits, before)


def test_mixed_batch_greedy_rows_stay_greedy():
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0)]
    for _ in range(5):
        out = Sampler()(logits, _meta(params)).sampled_token_ids
        assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_top_k_restricts_support_to_k_most_likely():
    torch.manual_seed(2)
    row = torch.randn(V)
    allowed = set(row.topk(3).indices.tolist())
    seen = _draw(row, SamplingParams(temperature=5.0, top_k=3), 400)
    assert seen == allowed


def test_top_p_keeps_smallest_prefix_reaching_p():
    row = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05] + [1e-9] * (V - 5)))
    # 0.5 + 0.3 = 0.8 >= 0.75: the nucleus is exactly {0, 1}.
    seen = _draw(row, SamplingParams(temperature=1.0, top_p=0.75), 400)
    assert seen == {0, 1}
    # A tiny top_p still keeps the single most likely token.
    assert _draw(row, SamplingParams(temperature=1.0, top_p=0.01), 100) == {0}


def test_top_k_and_top_p_combine_per_row():
    row = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1] + [1e-9] * (V - 4)))
    seen = _draw(row, SamplingParams(temperature=1.0, top_k=3, top_p=0.95), 500)
    assert seen == {0, 1, 2}
    logits = torch.stack([row, row])
    params = [SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=1.0, top_p=0.65)]
    for _ in range(20):
        a, b = Sampler()(logits, _meta(params)).sampled_token_ids.tolist()
        assert a == 0 and b in (0, 1)


def test_min_p_drops_tokens_below_fraction_of_top():
    row = torch.log(torch.tensor([0.5, 0.2, 0.1, 0.04] + [0.16 / (V - 4)] * (V - 4)))
    # threshold 0.3 * 0.5 = 0.15: only tokens 0 and 1 survive.
    assert _draw(row, SamplingParams(temperature=1.0, min_p=0.3), 400) == {0, 1}


def test_sampling_frequencies_follow_probabilities():
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (V - 3))
    row = torch.log(probs.clamp_min(1e-30))
    torch.manual_seed(3)
    n = 4000
    out = Sampler()(row.unsqueeze(0).repeat(n, 1), _meta([SamplingParams()] * n))
    counts = torch.bincount(out.sampled_token_ids, minlength=V).float() / n
    assert torch.allclose(counts[:3], probs[:3], atol=0.035)
    assert counts[3:].sum() == 0


def _reference_penalties(logits, prompt, output, rep, pres, freq):
    ref = logits.clone()
    for t in set(prompt) | set(output):
        ref[t] = ref[t] / rep if ref[t] > 0 else ref[t] * rep
    for t in set(output):
        ref[t] -= freq * output.count(t) + pres
    return ref


def test_penalties_match_hand_computed_reference():
    torch.manual_seed(4)
    logits = torch.randn(2, V) * 3
    prompts = [[1, 2, 3, 3], [10, 11]]
    outputs = [[3, 5, 5, 5, 7], [11, 12, 12]]
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.7, presence_penalty=0.4,
                       frequency_penalty=0.3),
        SamplingParams(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.5),
    ]
    meta = _meta(params, prompts, outputs)
    from engine.runner.sampling_ops import apply_penalties

    got = apply_penalties(logits.clone(), meta.prompt_tokens, meta.output_tokens,
                          meta.repetition_penalties, meta.presence_penalties,
                          meta.frequency_penalties)
    for i, p in enumerate(params):
        ref = _reference_penalties(logits[i], prompts[i], outputs[i], p.repetition_penalty,
                                   p.presence_penalty, p.frequency_penalty)
        assert torch.allclose(got[i], ref, atol=1e-6)
    out = Sampler()(logits, meta).sampled_token_ids
    assert out.tolist() == got.argmax(-1).tolist()


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.zeros(1, V)
    logits[0, 7] = 2.0
    logits[0, 9] = 1.5
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    out = Sampler()(logits, _meta([p], prompts=[[7]])).sampled_token_ids
    assert out.tolist() == [9]  # 2.0 / 2 = 1.0 < 1.5


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, V)
    logits[0, 5] = 10.0  # eos
    logits[0, 6] = 9.0  # stop token
    logits[0, 8] = 1.0
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[6])
    s = Sampler()
    assert s(logits, _meta([p], outputs=[[1]], eos=[5])).sampled_token_ids.tolist() == [8]
    # Reached min_tokens: eos wins again.
    assert s(logits, _meta([p], outputs=[[1, 2]], eos=[5])).sampled_token_ids.tolist() == [5]
    # ignore_eos: eos is not a stop token, so it is not masked, but stop ids still are.
    p2 = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[6], ignore_eos=True)
    assert s(logits, _meta([p2], outputs=[[]], eos=[5])).sampled_token_ids.tolist() == [5]
    logits[0, 5] = 0.0
    assert s(logits, _meta([p2], outputs=[[]], eos=[5])).sampled_token_ids.tolist() == [8]


def test_seeded_rows_do_not_depend_on_batch_companions():
    torch.manual_seed(5)
    steps = [torch.randn(V) for _ in range(6)]
    seeded = SamplingParams(temperature=1.0, seed=1234, top_p=0.9)

    def run(position: int, companions: int, comp_params: SamplingParams) -> list[int]:
        gen = _gen(1234)
        toks = []
        for step, row in enumerate(steps):
            n = companions + 1
            logits = torch.randn(n, V)
            logits[position] = row
            params = [comp_params] * n
            params[position] = seeded
            gens = [None] * n
            gens[position] = gen
            torch.manual_seed(1000 + step + companions)  # companions draw differently
            out = Sampler()(logits, _meta(params, gens=gens))
            toks.append(out.sampled_token_ids[position].item())
        return toks

    alone = run(0, 0, seeded)
    assert run(2, 4, SamplingParams(temperature=0.8)) == alone
    assert run(1, 3, SamplingParams(temperature=0.0, logprobs=2)) == alone
    assert run(0, 7, SamplingParams(temperature=1.3, top_k=4, min_p=0.1)) == alone
    # A different seed gives a different sequence (overwhelmingly likely over 6 steps).
    other = _gen(99)
    toks = [Sampler()(r.unsqueeze(0), _meta([seeded], gens=[other])).sampled_token_ids.item()
            for r in steps]
    assert toks != alone


def test_logprobs_are_raw_log_softmax_with_sampled_rank():
    torch.manual_seed(6)
    logits = torch.randn(3, V)
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5),
        SamplingParams(temperature=0.9, logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler()(logits, _meta(params, outputs=[[int(logits[0].argmax())], [], []]))
    ref = torch.log_softmax(logits, dim=-1)
    lp0, lp1, lp2 = out.logprobs
    assert lp2 is None
    s0 = out.sampled_token_ids[0].item()
    assert lp0.token_ids[0] == s0
    assert lp0.token_ids[1:] == ref[0].topk(3).indices.tolist()
    assert lp0.logprobs == pytest.approx([ref[0, s0].item()] + ref[0].topk(3).values.tolist(),
                                         abs=1e-5)
    # The penalty moved the argmax away from the raw top token: its rank shows it.
    assert lp0.sampled_rank == int((ref[0] > ref[0, s0]).sum()) + 1 and lp0.sampled_rank >= 2
    s1 = out.sampled_token_ids[1].item()
    assert lp1.token_ids == [s1] and len(lp1.logprobs) == 1
    assert lp1.logprobs[0] == pytest.approx(ref[1, s1].item(), abs=1e-5)
    assert lp1.sampled_rank == int((ref[1] > ref[1, s1]).sum()) + 1
    assert all(math.isfinite(x) for x in lp0.logprobs + lp1.logprobs)


def test_greedy_with_logprobs_has_rank_one():
    torch.manual_seed(7)
    logits = torch.randn(2, V)
    out = Sampler()(logits, _meta([SamplingParams(temperature=0.0, logprobs=5)] * 2))
    for i, lp in enumerate(out.logprobs):
        assert lp.sampled_rank == 1
        assert lp.token_ids[0] == lp.token_ids[1] == logits[i].argmax().item()
        assert len(lp.token_ids) == 6


def test_metadata_rejects_mismatched_lengths_and_shapes():
    with pytest.raises(ValueError):
        build_sampling_metadata([SamplingParams()], [[1]], [], [None], [None])
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(2, V), _meta([SamplingParams()]))


def test_filters_and_repetition_penalty_match_hugging_face():
    tf = pytest.importorskip("transformers.generation.logits_process")
    from engine.runner.sampling_ops import apply_min_p, apply_penalties, apply_top_k_top_p

    torch.manual_seed(8)
    scores = torch.randn(4, V) * 2
    neg = float("-inf")
    for k in (1, 5, 20):
        ours = apply_top_k_top_p(scores.clone(), torch.full((4,), k), None)
        hf = tf.TopKLogitsWarper(k, filter_value=neg)(None, scores.clone())
        assert torch.equal(ours.isinf(), hf.isinf())
    for p in (0.1, 0.5, 0.9):
        ours = apply_top_k_top_p(scores.clone(), None, torch.full((4,), p))
        hf = tf.TopPLogitsWarper(p, filter_value=neg)(None, scores.clone())
        assert torch.equal(ours.isinf(), hf.isinf())
    for mp in (0.05, 0.3):
        ours = apply_min_p(scores.clone(), torch.full((4,), mp))
        hf = tf.MinPLogitsWarper(mp, filter_value=neg)(None, scores.clone())
        assert torch.equal(ours.isinf(), hf.isinf())
    history = torch.randint(0, V, (4, 12))
    rows = torch.arange(4).repeat_interleave(8), torch.arange(4).repeat_interleave(4)
    ours = apply_penalties(scores.clone(), (rows[0], history[:, :8].reshape(-1)),
                           (rows[1], history[:, 8:].reshape(-1)),
                           torch.full((4,), 1.3), torch.zeros(4), torch.zeros(4))
    hf = tf.RepetitionPenaltyLogitsProcessor(1.3)(history, scores.clone())
    assert torch.allclose(ours, hf)


def _support(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """Reference support from the full-sort filter (itself checked against HF above)."""
    from engine.runner.sampling_ops import apply_top_k_top_p

    masked = apply_top_k_top_p(row.unsqueeze(0).clone(), torch.tensor([top_k]),
                               torch.tensor([top_p]))
    return set(torch.nonzero(~masked[0].isinf()).squeeze(1).tolist())


def test_wide_vocabulary_top_p_matches_full_sort_support_including_fallback():
    wide = 5000
    torch.manual_seed(9)
    peaked = torch.randn(wide) * 3
    support = _support(peaked, 0, 0.8)
    assert 2 < len(support) < 1024  # nucleus inside the candidate set
    torch.manual_seed(10)
    got = _draw(peaked, SamplingParams(temperature=1.0, top_p=0.8), 600)
    assert got <= support and len(got) >= min(len(support), 5)

    flat = torch.linspace(0.0, 1e-3, wide)  # near uniform: the nucleus is ~2500 tokens
    support = _support(flat, 0, 0.5)
    assert len(support) > 2000
    got = _draw(flat, SamplingParams(temperature=1.0, top_p=0.5), 300)
    assert got <= support
    assert any(t < wide - 1024 for t in got)  # resampled beyond the 1024 candidates

    # top_k wider than the candidate cap takes the full-sort path.
    got = _draw(flat, SamplingParams(temperature=1.0, top_k=4500), 200)
    assert got <= set(range(wide - 4500, wide)) and any(t < wide - 4096 for t in got)


def test_mixed_truncated_and_plain_rows_in_one_batch():
    row = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1] + [1e-9] * (V - 4)))
    logits = torch.stack([row] * 4)
    logits[1] = torch.zeros(V)  # uniform, untruncated
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=0.0)]
    seen1 = set()
    torch.manual_seed(11)
    for _ in range(200):
        a, b, c, d = Sampler()(logits, _meta(params)).sampled_token_ids.tolist()
        assert a in (0, 1) and c in (0, 1) and d == 0
        seen1.add(b)
    assert len(seen1) > V // 2


def test_the_runners_metadata_copies_histories_only_for_penalties_and_counts_outputs():
    """The runner passes each row's history to the metadata only when a penalty reads it;
    otherwise ranges of the right lengths stand in, and min_tokens still counts the outputs
    each row has: the same masks and penalties as with the real histories."""
    from engine.runner.model_runner import CachedRequest, ModelRunner

    def row(i, params, n_out):
        return CachedRequest(f"r{i}", [7, 8, 9] + [3] * n_out, 3, params, [], 0, 5)

    plain = SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[6])
    rows = [row(0, plain, 2), row(1, plain, 4)]
    got = ModelRunner._sampling_metadata(rows)
    want = build_sampling_metadata([r.params for r in rows], [[7, 8, 9]] * 2,
                                   [[3, 3], [3] * 4], [None] * 2, [5, 5])
    assert [t.tolist() for t in got.min_tokens_mask] == [[0, 0], [5, 6]]
    assert [t.tolist() for t in want.min_tokens_mask] == [[0, 0], [5, 6]]
    assert got.prompt_tokens is None and not got.plain_greedy

    penal = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    rows = [row(0, penal, 3), row(1, SamplingParams(temperature=0.0), 1)]
    got = ModelRunner._sampling_metadata(rows)
    assert [t.tolist() for t in got.prompt_tokens] == [[0, 0, 0, 1, 1, 1], [7, 8, 9] * 2]
    assert [t.tolist() for t in got.output_tokens] == [[0, 0, 0, 1], [3, 3, 3, 3]]
    assert ModelRunner._sampling_metadata([row(0, SamplingParams(temperature=0.0), 9)]
                                          ).plain_greedy
