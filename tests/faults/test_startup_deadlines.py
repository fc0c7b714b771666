"""A start-up that cannot finish ends the server with a non-zero exit and a log line naming the
stage (issue 26, finding 9; engine/core/startup.py). Each test stalls one stage on purpose
(PDSERVE_FAULT_STALL_STARTUP) under a short --startup-stage-timeout: STAGE=S for that stage
alone (every honest stage keeps its default, so a busy machine cannot end one first), or S for
every stage (the TP case: the stages containing the workers' must outlast theirs)."""

from __future__ import annotations

import os
import time

import pytest
from fault_kit import LOG_DIR
from pd_harness import TEST_ENV, role_args

from engine.net import free_port
from engine.startup import EXIT_STARTUP_STALLED
from pdserve.launcher import launch_server

STAGE_S = 30.0  # every stage's: above every honest stage of a tiny model on a busy machine
ONE_STAGE_S = 3.0  # the stalled stage's alone: the test waits for it
BOUND = 180.0  # start-up of a tiny model on a busy 2-core machine + the deadline


@pytest.mark.parametrize(("stage", "tp", "flag", "deadline"), [
    ("kv_connector", 1, f"kv_connector={ONE_STAGE_S}", ONE_STAGE_S),
    ("model", 1, f"model={ONE_STAGE_S}", ONE_STAGE_S),
    ("rendezvous", 2, str(STAGE_S), STAGE_S)])
def test_a_stalled_startup_stage_ends_the_server_naming_it(tiny_model: str, stage: str,
                                                           tp: int, flag: str,
                                                           deadline: float) -> None:
    log = os.path.join(LOG_DIR, f"stall-{stage}.log")
    server = launch_server(
        tiny_model, *role_args(64, None, "NixlPushConnector", f"S{stage}", free_port(count=2),
                               "--tensor-parallel-size", str(tp),
                               "--startup-stage-timeout", flag),
        module="decode", env={**TEST_ENV, "PDSERVE_FAULT_STALL_STARTUP": stage}, wait=False,
        log_path=log)
    started = time.monotonic()
    try:
        code = server.process.wait(BOUND)
    finally:
        server.stop(10)
    took = time.monotonic() - started
    text = open(log, errors="replace").read()
    assert code not in (0, None), f"exit code {code}"
    assert f"start-up stage {stage!r} stalled past its deadline of {deadline:.0f}s" in text, \
        text[-3000:]
    assert f"code {EXIT_STARTUP_STALLED}" in text  # the frontend says why the server ends
    assert took < BOUND
    assert not server.descendants()  # nothing left behind
