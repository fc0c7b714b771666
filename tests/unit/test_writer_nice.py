"""P's push transfer thread is niced (its WRITE copies yield to P's server sending token 1);
D's is not; $PDSERVE_KV_WRITER_NICE overrides either, and a bad value is refused naming it."""

from __future__ import annotations

import pytest

from kvconnector.push.connector import DEFAULT_WRITER_NICE, WRITER_NICE_ENV, writer_nice


def test_prefill_only_engines_nice_their_writer(monkeypatch) -> None:
    monkeypatch.delenv(WRITER_NICE_ENV, raising=False)
    assert writer_nice("kv_producer") == DEFAULT_WRITER_NICE > 0
    assert writer_nice("kv_consumer") == 0
    assert writer_nice("kv_both") == 0


@pytest.mark.parametrize("raw, want", [("0", 0), ("19", 19), ("5", 5)])
def test_the_environment_overrides_either_role(monkeypatch, raw: str, want: int) -> None:
    monkeypatch.setenv(WRITER_NICE_ENV, raw)
    assert writer_nice("kv_producer") == writer_nice("kv_consumer") == want


@pytest.mark.parametrize("raw", ["-1", "20", "x", ""])
def test_a_bad_value_is_refused_naming_the_variable(monkeypatch, raw: str) -> None:
    monkeypatch.setenv(WRITER_NICE_ENV, raw)
    with pytest.raises(ValueError, match=WRITER_NICE_ENV):
        writer_nice("kv_producer")
