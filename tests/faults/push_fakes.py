"""Plain-data stand-ins for the push writer's unit tests: an injectable clock and a NIXL
transport that records instead of transferring."""

from __future__ import annotations

from kvconnector import wire


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeTransport:
    """A NIXL transport that records what it is asked to send and write; `loaded` are the
    agents it has loaded (`peers()`), `inbox` what the next `get_new_notifs` returns."""

    def __init__(self, loaded: tuple[str, ...] = ()) -> None:
        self.inbox: list[tuple[str, bytes]] = []
        self.sent: list[tuple[str, bytes]] = []
        self.writes: list[tuple[str, list[int], list[int]]] = []
        self.loaded = set(loaded)

    def get_new_notifs(self) -> list[tuple[str, bytes]]:
        out, self.inbox = self.inbox, []
        return out

    def send_notif(self, agent: str, msg: bytes) -> None:
        self.sent.append((agent, msg))

    def write(self, agent: str, p_ids: list[int], d_ids: list[int], notif: bytes) -> object:
        self.writes.append((agent, list(p_ids), list(d_ids)))
        return object()

    def check(self, handle: object) -> str:
        return "DONE"

    def release(self, handle: object) -> bool:
        return True

    def peers(self) -> list[str]:
        return sorted(self.loaded)

    def kinds(self) -> list[str]:
        return [wire.notif_kind(m) for _, m in self.sent if not m.startswith(b"HB:")]
