"""Signed pull-mode kv_transfer_params with plain data and an injected clock: what P signs,
what D accepts, and every forgery D refuses naming the field (HTTP 400 at admission).
The scheduler half under a secret is driven through real Schedulers, as in
test_pull_scheduler.py. No processes, no sleeps."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from engine.connector_api import KVCacheSpec
from engine.connector_registry import kv_params_validator
from engine.kv_transfer_config import KVTransferConfig
from engine.protocol import SamplingParams
from engine.runner_output import ModelRunnerOutput
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler
from kvconnector.pull import signing
from kvconnector.pull.params import request_params_validator
from kvconnector.pull.scheduler import PullScheduler
from kvconnector.security import KVSecurity, prompt_digest

SECRET = "pull-signing-test-secret-0123456789"
SEC = KVSecurity(SECRET.encode())
NOW = 1_700_000_000.0
LEASE = 10.0
PROMPT = list(range(300, 310))  # 10 tokens: 3 blocks of 4


def _answer(prompt: list[int] = PROMPT, **over) -> dict:
    """P's answer for `prompt`, signed with SEC (fields overridden before signing)."""
    p = {"do_remote_prefill": True, "remote_engine_id": "P0", "remote_host": "10.0.0.1",
         "remote_port": 7001, "tp_size": 1, "remote_request_id": "p-req-0badcafe",
         "remote_block_ids": [4, 9, 2], "num_prompt_tokens": len(prompt),
         "prompt_digest": prompt_digest(prompt), "lease_expires_at": NOW + LEASE, **over}
    return signing.signed(SEC, p)


def test_p_signs_its_answer_and_d_accepts_it_unchanged_and_after_a_json_round_trip():
    answer = _answer()
    assert len(answer["signature"]) == 64
    signing.check(SEC, answer, PROMPT, now=NOW)
    signing.check(SEC, json.loads(json.dumps(answer)), PROMPT, now=NOW)
    # A proxy that re-encodes a whole-number expiry as an int changes nothing.
    whole = _answer(lease_expires_at=NOW + 10)
    signing.check(SEC, {**whole, "lease_expires_at": int(NOW + 10)}, PROMPT, now=NOW)


@pytest.mark.parametrize(("field", "value"), [
    ("remote_engine_id", "P1"), ("remote_host", "10.0.0.2"), ("remote_port", 7002),
    ("tp_size", 2), ("remote_request_id", "someone-elses-request"),
    ("remote_block_ids", [4, 9, 3]), ("remote_block_ids", [9, 4, 2]),
    ("remote_block_ids", [4, 9]), ("num_prompt_tokens", 9),
    ("prompt_digest", prompt_digest([1, 2, 3])), ("lease_expires_at", NOW + 3600),
])
def test_changing_any_field_d_acts_on_breaks_the_signature(field, value):
    forged = {**_answer(), field: value}
    with pytest.raises(ValueError, match=r"^kv_transfer_params\.signature does not match"):
        signing.check(SEC, forged, PROMPT, now=NOW)


@pytest.mark.parametrize(("signature", "message"), [
    (None, "is required"), ("", "64-character hex"), (123, "64-character hex"),
    ("zz" * 32, "must be a hex string"), ("00" * 32, "does not match"),
])
def test_missing_or_wrong_signature_is_refused_naming_the_field(signature, message):
    answer = _answer()
    forged = {k: v for k, v in answer.items() if k != "signature"}
    if signature is not None:
        forged["signature"] = signature
    with pytest.raises(ValueError, match=rf"^kv_transfer_params\.signature .*{message}"):
        signing.check(SEC, forged, PROMPT, now=NOW)


def test_a_signature_made_with_another_secret_is_refused():
    other = KVSecurity(b"another-secret-of-enough-length")
    answer = signing.signed(other, {k: v for k, v in _answer().items() if k != "signature"})
    with pytest.raises(ValueError, match=r"signature does not match"):
        signing.check(SEC, answer, PROMPT, now=NOW)


def test_a_valid_signature_for_another_prompt_is_refused():
    other = list(range(400, 410))  # same length: only the digest tells them apart
    with pytest.raises(ValueError, match=r"^kv_transfer_params\.prompt_digest does not match"):
        signing.check(SEC, _answer(other), PROMPT, now=NOW)


def test_params_are_accepted_until_the_margin_before_the_lease_ends():
    answer = _answer()
    last = NOW + LEASE - signing.LEASE_MARGIN_S
    signing.check(SEC, answer, PROMPT, now=last)
    with pytest.raises(ValueError, match=r"^kv_transfer_params\.lease_expires_at has passed"):
        signing.check(SEC, answer, PROMPT, now=last + 0.001)


@pytest.mark.parametrize(("field", "value"), [
    ("prompt_digest", None), ("lease_expires_at", None), ("lease_expires_at", float("inf")),
    ("lease_expires_at", float("nan")), ("lease_expires_at", True), ("prompt_digest", 7),
])
def test_signed_params_need_a_digest_and_a_finite_expiry(field, value):
    answer = {**_answer(), field: value}
    if value is None:
        del answer[field]
    with pytest.raises(ValueError, match=rf"^kv_transfer_params\.{field} "):
        signing.check(SEC, answer, PROMPT, now=NOW)


def test_without_a_secret_nothing_is_signed_and_nothing_is_required():
    plain = KVSecurity()
    unsigned = {k: v for k, v in _answer().items() if k != "signature"}
    assert signing.signed(plain, unsigned) == unsigned
    signing.check(plain, {**unsigned, "remote_block_ids": [0, 1, 2]}, [1], now=NOW + 1e6)


def test_the_tag_is_bound_to_pull_params_not_reusable_as_another_mac():
    unsigned = {k: v for k, v in _answer().items() if k != "signature"}
    parts = signing._parts(unsigned)
    assert parts[0] == signing.DOMAIN
    assert SEC.mac(*parts[1:]).hex() != signing.sign(SEC, unsigned)


# ---- the frontend validator (engine.connector_registry hook) -----------------------------------


def _config(extra: dict) -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=KVTransferConfig(
        kv_connector="NixlConnector", engine_id="D0", kv_connector_extra_config=extra))


def test_engine_validator_checks_types_then_signature_prompt_and_expiry_with_its_clock():
    clock = SimpleNamespace(t=NOW)
    validate = request_params_validator(_config({"kv_secret": SECRET}), lambda: clock.t)
    validate(_answer(), PROMPT)
    validate({"do_remote_decode": True}, PROMPT)  # a P leg carries nothing to sign
    with pytest.raises(ValueError, match=r"kv_transfer_params\.remote_block_ids"):
        validate({**_answer(), "remote_block_ids": [-1, 0, 1]}, PROMPT)
    with pytest.raises(ValueError, match=r"kv_transfer_params\.prompt_digest"):
        validate(_answer(), [*PROMPT[:-1], 1])
    clock.t = NOW + LEASE
    with pytest.raises(ValueError, match=r"kv_transfer_params\.lease_expires_at"):
        validate(_answer(), PROMPT)


def test_engine_without_a_secret_admits_unsigned_params_as_before(monkeypatch):
    monkeypatch.delenv("PDSERVE_KV_SECRET", raising=False)
    validate = kv_params_validator(_config({}))
    assert validate is not None
    unsigned = {k: v for k, v in _answer().items() if k != "signature"}
    validate({**unsigned, "remote_block_ids": [0, 1, 2]}, [5, 6])


# ---- the scheduler half under a secret ---------------------------------------------------

BS, NUM_BLOCKS = 4, 64


def _engine(engine_id: str, port: int, secret: str | None):
    extra = {"kv_lease_duration": LEASE, **({"kv_secret": secret} if secret else {})}
    kv = KVTransferConfig(kv_connector="NixlConnector", engine_id=engine_id, kv_port=port,
                          kv_connector_extra_config=extra)
    spec = KVCacheSpec(num_blocks=NUM_BLOCKS, block_size=BS, num_layers=1, num_kv_heads=1,
                       head_dim=4, dtype="float32", bytes_per_block=64, model_name="m")
    conn = PullScheduler(SimpleNamespace(kv_transfer_config=kv), spec, clock=lambda: NOW,
                         wall_clock=lambda: NOW)
    sched = Scheduler(block_size=BS, num_blocks=NUM_BLOCKS, max_num_seqs=8,
                      max_num_batched_tokens=64, max_model_len=256, connector=conn,
                      clock=lambda: NOW)
    return sched, conn


def _req(rid: str, prompt: list[int], kv: dict, max_tokens: int = 3) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), None,
                   kv_transfer_params=kv)


def _p_answer(prompt: list[int]) -> dict:
    p, _ = _engine("P0", 7001, SECRET)
    p.add_request(_req("p-req-0badcafe", prompt, {"do_remote_decode": True}, max_tokens=1))
    so = p.schedule()
    ids = list(so.num_scheduled_tokens)
    outs = p.update_from_output(so, ModelRunnerOutput(
        req_ids=ids, sampled_token_ids=[[5]] * len(ids), logprobs=[None] * len(ids)))
    return outs[0].kv_transfer_params


def test_p_with_a_secret_answers_with_a_signature_d_verifies():
    answer = _p_answer(PROMPT)
    signing.check(SEC, answer, PROMPT, now=NOW)
    d, dc = _engine("D0", 7002, SECRET)
    d.add_request(_req("d1", PROMPT, answer))
    so = d.schedule()
    assert [r.remote_block_ids for r in so.kv_connector_metadata.reads] == [
        answer["remote_block_ids"]]
    assert dc.get_stats()["kv_pull_refused_params_total"] == 0


def test_scheduler_with_a_secret_never_reads_params_that_bypassed_admission():
    answer = _p_answer(PROMPT)
    d, dc = _engine("D0", 7002, SECRET)
    forged = [b + 1 for b in answer["remote_block_ids"]]  # the next user's blocks, say
    d.add_request(_req("d1", PROMPT, {**answer, "remote_block_ids": forged}))
    so = d.schedule()
    assert so.num_scheduled_tokens == {"d1": len(PROMPT)}  # prefills locally
    assert not so.kv_connector_metadata.brings_work()
    assert dc.get_stats()["kv_pull_refused_params_total"] == 1
