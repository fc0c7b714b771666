"""The busy loop of an engine that must step together with the other DP ranks.

Models whose forward pass is collective across DP ranks (expert parallel MoE) cannot let one
rank step while another sits idle. Within a request wave every engine steps: with requests a
real step, without them a dummy step. The coordinator starts a wave when any engine gets a
request (StartWave → StartDPWave to all) and ends it once every engine is idle
(WaveComplete). Dense models do not need this; `data_parallel_lockstep` turns it on.

A dummy step here runs no model (the model runner is not ours to change); it waits up to
`DUMMY_STEP_S` for input, is counted (`num_dummy_steps`), and keeps the rank in the wave.
"""

from __future__ import annotations

from typing import Any

from engine.core.busy_loop import EngineCoreLoop, InputKind
from engine.dp.engine_link import CoordinatorLink
from engine.dp.messages import StartDPWave, WaveComplete

DUMMY_STEP_S = 0.005


class LockstepLoop(EngineCoreLoop):
    def __init__(self, core: Any, engine_index: int, link: CoordinatorLink) -> None:
        super().__init__(core, engine_index)
        self.link = link
        self.engines_running = False
        self.num_dummy_steps = 0
        self.num_waves_started = 0

    def run(self) -> None:
        while True:
            if not self.core.has_work() and not self.engines_running:
                if self._stopping:
                    return
                self._clear_aborts_queue()
                self._handle(*self.input_queue.get())
            self._drain_inputs()
            if self._stopping:
                self._enforce_drain_deadline()
                if not self.core.has_work():
                    return
            if self.core.has_work():
                self._step()
            elif self.engines_running:
                self._dummy_step()

    def _dummy_step(self) -> None:
        self.num_dummy_steps += 1
        self._handle_next(DUMMY_STEP_S)

    def _handle(self, kind: InputKind, payload: Any) -> None:
        if kind is InputKind.DP_CONTROL:
            self._on_wave(payload)
            return
        super()._handle(kind, payload)
        if kind is InputKind.ADD and not self.engines_running and self._has_requests():
            self._start_wave()

    def _has_requests(self) -> bool:
        # Not has_work(): that also covers a last bookkeeping step after requests finished.
        return self.core.scheduler.get_num_unfinished_requests() > 0

    def _start_wave(self) -> None:
        self.engines_running = True
        self.num_waves_started += 1
        self.link.start_wave(self.link.wave)
        self.link.force_next_stats()  # the coordinator must hear when this engine is idle

    def _on_wave(self, msg: StartDPWave | WaveComplete) -> None:
        if isinstance(msg, StartDPWave):
            if msg.wave >= self.link.wave:
                self.link.wave, self.engines_running = msg.wave, True
            return
        if msg.wave >= self.link.wave:
            self.link.wave, self.engines_running = msg.wave + 1, False
            if self._has_requests():  # work came in after this engine last reported idle
                self._start_wave()

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "dp_wave": self.link.wave,
                "dp_engines_running": self.engines_running,
                "num_dummy_steps": self.num_dummy_steps,
                "num_waves_started": self.num_waves_started}
