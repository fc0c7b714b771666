"""engine/threads.py: the engine server's OpenMP default (issue 33 item 6)."""

from __future__ import annotations

import pytest

from engine.threads import SHARE_ENV, SPINCOUNT, USER_KNOBS, apply_thread_defaults


def test_sets_a_short_spin_when_the_user_chose_none() -> None:
    env = {"PATH": "/bin"}
    assert apply_thread_defaults(env) == {"GOMP_SPINCOUNT": SPINCOUNT, SHARE_ENV: "1"}
    assert env["GOMP_SPINCOUNT"] == SPINCOUNT
    assert int(SPINCOUNT) < 300_000  # below libgomp's own default spin


@pytest.mark.parametrize("knob", USER_KNOBS)
def test_a_users_own_wait_setting_is_kept(knob: str) -> None:
    env = {knob: "PASSIVE" if knob == "OMP_WAIT_POLICY" else "7"}
    assert apply_thread_defaults(env) == {SHARE_ENV: "1"}
    assert "GOMP_SPINCOUNT" not in env or env["GOMP_SPINCOUNT"] == "7"
