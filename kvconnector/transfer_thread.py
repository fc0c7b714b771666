"""The transfer thread both connectors run: sole owner of a worker's NIXL notifications and
transfers, woken by an event and polling only while work is outstanding.

Wakes on its event: `start_load_kv` (only when the step brings new work), `get_finished`
(every step), a finished handshake or probe, or its own timer. It polls every 1 ms only while
work is outstanding (a transfer progresses only while both agents are polled: see
`kvconnector.nixl`) and otherwise sleeps until the sink's next deadline, so an idle engine
costs no CPU.

A mode subclasses it with only its policy: a `name`, two halves and two routing tables.
- `source`: this engine's blocks other engines take (P side, a `Half`); `sink`: blocks this
  engine receives (D side, a `Sink`). Each half has `poll()`, `needs_poll()`,
  `next_deadline()` (when it must poll next while idle, or None), `table_sizes()` and a
  `done` set of request ids whose blocks may be freed; the sink also has `finished_recving`
  and `failed_recving`. With `prune_idle` both halves are `Prunable` too.
- `make_inbox_routes()`: field of the scheduler's per-step metadata -> handler of one item,
  in the order they run;
- `make_notif_routes()`: decoded notification type (`kvconnector.wire`) -> handler
  `(message, sender agent, seen_after)`. A type without a route is counted malformed.

Threads: the halves, `peers` (apart from its executors' queue) and the transport's
notifications belong to this thread. Cross-thread hand-off: the engine thread puts metadata
in `inbox` and reads `outbox` with `collect()`; nothing else is shared.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

from engine.connector_api import KVConnectorOutput
from engine.connector_seam import KVConnectorMetadata, SeededToken
from kvconnector import wire

if TYPE_CHECKING:
    from kvconnector.peers import Address, Peers
    from kvconnector.transport import Transport

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.001
_IDLE_TICK_S = 1.0  # upper bound on a sleep, so a lost wake costs at most this
_PRUNE_EVERY_S = 1.0
# D waiting for a WRITE polls this slowly until P's poke (kvconnector/poke.py) says one was
# posted, then every POLL_INTERVAL_S until as many notifications as pokes have arrived, for
# FAST_AFTER_POKE_S at most. P pokes for every notification it sends D (the WRITE's
# completion, PUSH_FAIL, PUSH_CANCEL_ACK), so the slow poll only bounds a lost poke and carries
# the heartbeats: at 20 ms it cost ~1 % of a core with legs waiting. (Polling fast for the
# whole second after every poke kept a loaded D polling every millisecond throughout: 0.6-1.0
# s of D's CPU in issue 33's 400-request run.)
WAIT_POLL_S = 0.25
FAST_AFTER_POKE_S = 1.0
_MAX_EARLY = 1024  # notifications kept waiting for their pokes (a P that never pokes)
# after a pass that took scheduler work (D's PUSH_REGs go out): poll fast this long, so a
# send that needs this agent's progress leaves at once
FAST_AFTER_WORK_S = 0.02
_FULL_STEP_EVERY_S = 0.02  # while light ticks poll (`_light_tick`): a full pass at least this often

# (decoded message, sending NIXL agent, earliest time it may have arrived)
NotifHandler = Callable[[Any, str, float], None]


class Half(Protocol):
    """One side of a transfer thread (push: `Sender` / `Receiver`; pull: `Lender` /
    `Reader`). Touched by the transfer thread only; `done` is the thread's to empty."""

    done: set[str]  # request ids whose blocks may be freed

    def poll(self) -> None: ...
    def needs_poll(self) -> bool: ...  # poll every POLL_INTERVAL_S while True
    def next_deadline(self) -> float | None: ...  # when it must poll next while idle
    def table_sizes(self) -> dict[str, int]: ...


class Sink(Half, Protocol):
    """The receiving side (D): also what it received, or failed to, since the last publish."""

    finished_recving: set[str]
    failed_recving: dict[str, str]  # request id -> reason
    seeded: dict[str, SeededToken]  # request id -> the first token that came with its KV


class Prunable(Protocol):
    """A half of a mode with `prune_idle`: the peer addresses its live entries still use."""

    def addresses_in_use(self) -> set[Address]: ...


class TransferThread:
    name = "nixl-transfer"  # the thread's name; a mode names its own
    prune_idle = False  # prune idle peers (both halves then have `addresses_in_use()`)
    # the sink's waits end with a WRITE the source side announces (`poke`): poll slowly before
    sink_waits_for_poke = False
    # the notification types a poke announces (each one poked for arrives as one of these)
    poked_kinds: frozenset[type] = frozenset()

    def __init__(self, transport: Transport, peers: Peers, source: Half, sink: Sink,
                 wake: threading.Event, clock: Callable[[], float] = time.monotonic) -> None:
        self.t = transport
        self.peers = peers
        self.source = source
        self.sink = sink
        self.wake = wake
        self.clock = clock
        self.inbox_routes = self.make_inbox_routes()
        self.notif_routes = self.make_notif_routes()
        self.inbox: queue.SimpleQueue[KVConnectorMetadata] = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue[KVConnectorOutput] = queue.SimpleQueue()
        self.malformed = 0
        self._last_listen = clock()  # when this side last drained its notifications
        self._next_prune = clock() + _PRUNE_EVERY_S
        self._next_full = clock()  # a timer tick before this may be a light one
        self._fast_until = 0.0  # poll fast until then (a poke arrived) ...
        self._awaited = 0  # ... while this many poked notifications have not arrived
        self._early: collections.deque[float] = collections.deque()  # arrived before a poke
        self._awaited_lock = threading.Lock()  # poke() runs on the side channel's thread
        self._work_fast_until = 0.0  # poll fast until then (scheduler work went out)
        self._stop = False
        self.on_publish: Callable[[], None] | None = None  # wakes the engine (set_wakeup)
        self.nice = 0  # scheduling niceness of this thread (the mode's worker sets it)
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    # --- the mode's policy --------------------------------------------------------
    def make_inbox_routes(self) -> dict[str, Callable[[Any], None]]:
        """Field of the scheduler's per-step metadata -> handler of one item, in order."""
        raise NotImplementedError

    def make_notif_routes(self) -> dict[type, NotifHandler]:
        """Decoded notification type -> handler; a type without one is counted malformed."""
        raise NotImplementedError

    def counters(self) -> dict[str, float]:
        """The mode's cumulative counters (a fresh dict; read racily, as Prometheus does)."""
        raise NotImplementedError

    # --- engine thread ------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self.wake.set()
        self._thread.join(timeout=5)

    def poke(self) -> None:
        """A WRITE into this engine was posted (called on the side-channel thread): poll the
        agent fast until its notification arrives (FAST_AFTER_POKE_S at most). A notification
        that arrived before its poke (P's single-copy WRITE can complete before the poke's TCP
        round, and D polls fast just after its PUSH_REG) answers the poke at once."""
        now = self.clock()
        with self._awaited_lock:
            while self._early and self._early[0] < now - FAST_AFTER_POKE_S:
                self._early.popleft()  # too old to be this poke's: the poke was lost
            if self._early:
                self._early.popleft()
                return
            self._awaited += 1
            self._fast_until = now + FAST_AFTER_POKE_S
        self.wake.set()

    def _arrived(self, count: int) -> None:
        """`count` poked-for notifications arrived: as many awaited pokes are answered; the
        rest came before their pokes, which they answer when those come."""
        now = self.clock()
        with self._awaited_lock:
            answered = min(count, self._awaited)
            self._awaited -= answered
            self._early.extend([now] * (count - answered))
            while len(self._early) > _MAX_EARLY:
                self._early.popleft()

    def submit(self, meta: KVConnectorMetadata) -> None:
        """Hand the scheduler's per-step metadata over (only when it brings work)."""
        self.inbox.put(meta)
        self.wake.set()

    def collect(self) -> KVConnectorOutput:
        """Everything the thread finished since the last call."""
        out = KVConnectorOutput()
        while True:
            try:
                part = self.outbox.get_nowait()
            except queue.Empty:
                return out
            out.finished_sending |= part.finished_sending
            out.finished_recving |= part.finished_recving
            out.failed_recving.update(part.failed_recving)
            out.seeded.update(part.seeded)

    # --- the thread ---------------------------------------------------------------
    def step(self, notifs: list[tuple[str, bytes]] | None = None) -> None:
        """One pass: handshakes, scheduler work, inbound notifs, polls, results out.
        `notifs`: already drained by a light tick (`_light_tick`), dated like a drain now."""
        self._next_full = self.clock() + _FULL_STEP_EVERY_S
        self.peers.apply_finished()
        if self._drain_inbox():
            self._work_fast_until = self.clock() + FAST_AFTER_WORK_S
        # A notification first seen now was not there at the previous drain, so it was sent
        # after about then: date it so. Dating it "now" would let a P that was frozen (or
        # starved) for longer than the ttl take a stale PUSH_REG for a fresh one and WRITE
        # into blocks D has long given to other requests.
        listened, self._last_listen = self._last_listen, self.clock()
        if notifs is None:
            notifs = self.t.get_new_notifs()
        poked = 0
        for agent, raw in notifs:
            try:
                poked += self._dispatch(raw, agent, listened) in self.poked_kinds
            except Exception:  # noqa: BLE001 - one bad message must not lose the batch
                self.malformed += 1
                logger.exception("notification from %s dropped: %r", agent, raw[:64])
        if poked:
            self._arrived(poked)
        self.source.poll()
        self.sink.poll()
        if self.prune_idle:
            self._prune_idle_peers()
        self._publish()

    def _run(self) -> None:
        if self.nice > 0:  # this thread only (Linux: a thread is a task of its own), and
            # relative to the engine's own niceness (`nice pdserve ...` keeps the gap)
            try:
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid,
                               min(19, os.getpriority(os.PRIO_PROCESS, tid) + self.nice))
            except OSError as exc:
                logger.warning("%s: nice %d not applied (%s)", self.name, self.nice, exc)
        while not self._stop:
            woken = self.wake.wait(self._timeout())
            self.wake.clear()
            try:
                if woken or not self._light_tick():
                    self.step()
            except Exception:  # noqa: BLE001 - log and go on; the engine must not lose it
                logger.exception("%s step failed", self._thread.name)

    def _light_tick(self) -> bool:
        """A timer tick while only the sink waits for a WRITE to land (D waiting for KV):
        drive the agent's progress and look for notifications, nothing else, so waiting
        costs about one `get_new_notifs` per tick. True when that was all this tick needed;
        a notification, the source's work, a handshake or the full pass's period make it
        False (then `step` runs, with the notifications drained here)."""
        if (self.source.needs_poll() or self.peers.pending() or not self.inbox.empty()
                or self.clock() >= self._next_full):
            return False
        listened = self._last_listen
        notifs = self.t.get_new_notifs()
        if not notifs:
            self._last_listen = self.clock()  # they were not there at this drain either
            return True
        self._last_listen = listened
        self.step(notifs)
        return True

    def _drain_inbox(self) -> bool:
        """Hand the scheduler's metadata to the halves; True when there was some."""
        took = False
        while True:
            try:
                meta = self.inbox.get_nowait()
            except queue.Empty:
                return took
            took = True
            for name, handle in self.inbox_routes.items():
                for item in getattr(meta, name):
                    handle(item)

    def _dispatch(self, raw: bytes, agent: str, seen_after: float) -> type | None:
        """Route one notification; its decoded type (None: malformed). `agent`: the sender's
        NIXL agent name; the halves refuse (and count) a message from an agent other than the
        one the transfer belongs to."""
        try:
            msg = wire.decode_notif(raw)
        except wire.MalformedNotif as e:
            self.malformed += 1
            logger.warning("malformed notification from %s dropped (%s): %r", agent, e,
                           raw[:64])
            return None
        handle = self.notif_routes.get(type(msg))
        if handle is None:
            self.malformed += 1
            logger.warning("%s from %s dropped: not a notification of this mode",
                           type(msg).__name__, agent)
            return None
        handle(msg, agent, seen_after)
        return type(msg)

    def _prune_idle_peers(self) -> None:
        now = self.clock()
        if now < self._next_prune:
            return
        self._next_prune = now + _PRUNE_EVERY_S
        source, sink = cast(Prunable, self.source), cast(Prunable, self.sink)
        self.peers.prune(source.addresses_in_use() | sink.addresses_in_use())

    def _timeout(self) -> float:
        if self.source.needs_poll() or self.peers.pending():
            return POLL_INTERVAL_S
        if self.sink.needs_poll():
            now = self.clock()
            if (not self.sink_waits_for_poke or now < self._work_fast_until
                    or (self._awaited and now < self._fast_until)):
                return POLL_INTERVAL_S
            return WAIT_POLL_S
        deadlines = [d for d in (self.source.next_deadline(), self.sink.next_deadline())
                     if d is not None]
        if not deadlines:
            return _IDLE_TICK_S
        return min(_IDLE_TICK_S, max(POLL_INTERVAL_S, min(deadlines) - self.clock()))

    def _publish(self) -> None:
        src, sink = self.source, self.sink
        if not (src.done or sink.done or sink.finished_recving or sink.failed_recving
                or sink.seeded):
            return
        out = KVConnectorOutput(
            finished_sending=src.done | sink.done,
            finished_recving=set(sink.finished_recving),
            failed_recving=dict(sink.failed_recving),
            seeded=dict(sink.seeded),
        )
        src.done, sink.done = set(), set()
        sink.finished_recving, sink.failed_recving, sink.seeded = set(), {}, {}
        self.outbox.put(out)
        if self.on_publish is not None:
            self.on_publish()
