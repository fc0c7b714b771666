"""--startup-stage-timeout: S replaces every stage's deadline (container stages get their span
times it), STAGE=S[,STAGE=S] only the stages named; a bad value is a usage error naming it."""

from __future__ import annotations

import argparse

import pytest

from engine.server.cli import add_deadline_args
from engine.startup import STAGE_DEADLINES, parse_stage_timeout, stage_deadline


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_deadline_args(parser)
    return parser.parse_args(list(argv))


def test_one_number_replaces_every_stage_and_spans_the_container_stages() -> None:
    override = _parse("--startup-stage-timeout", "10").startup_stage_timeout_s
    assert override == 10.0
    assert stage_deadline("model", override) == 10.0
    assert stage_deadline("kv_connector", override) == 10.0
    assert stage_deadline("tp_workers", override) == 60.0  # outlasts the workers' stages
    assert stage_deadline("engine_core_start", override) == 80.0


def test_named_stages_get_their_deadline_and_the_others_keep_their_default() -> None:
    args = _parse("--startup-stage-timeout", "model=2.5, kv_connector=4")
    override = args.startup_stage_timeout_s
    assert override == {"model": 2.5, "kv_connector": 4.0}
    assert stage_deadline("model", override) == 2.5
    assert stage_deadline("kv_connector", override) == 4.0
    for stage in set(STAGE_DEADLINES) - {"model", "kv_connector"}:
        assert stage_deadline(stage, override) == STAGE_DEADLINES[stage], stage
    assert stage_deadline("model", None) == STAGE_DEADLINES["model"]


@pytest.mark.parametrize(("value", "named"), [
    ("modle=3", "unknown start-up stage 'modle'"), ("model=soon", "could not convert"),
    ("soon", "could not convert")])
def test_a_bad_value_is_a_usage_error_naming_it(value: str, named: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse("--startup-stage-timeout", value)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err, err
    if "unknown" in named:
        assert "kv_connector" in err and "rendezvous" in err  # the stages there are


def test_a_named_stage_deadline_must_be_positive(tiny_model: str) -> None:
    from engine.config import EngineConfig

    assert parse_stage_timeout("model=0") == {"model": 0.0}
    with pytest.raises(ValueError, match="startup_stage_timeout_s must be positive"):
        EngineConfig(model=tiny_model, startup_stage_timeout_s={"model": 0.0})
    with pytest.raises(ValueError, match="startup_stage_timeout_s must be positive"):
        EngineConfig(model=tiny_model, startup_stage_timeout_s=-1.0)
