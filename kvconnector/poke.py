"""P's notice to D that a WRITE into D was posted (`handshake_msgs.Poke` on D's side channel).

Why: a WRITE completes, and its completion notification reaches D, only while D's agent is
polled (kvconnector/nixl.py). D waiting for KV used to poll every millisecond for the whole
wait (P's queue and prefill included); now it polls slowly while it waits and fast only once
P has posted a WRITE into it, which P announces here. A lost or missing poke (an older P)
costs at most the slow interval (`transfer_thread.WAIT_POLL_S`), never the request.

Threads: `Poker` belongs to P's transfer thread; sends never block (a notice that cannot
be queued is dropped).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import msgspec
import zmq

from kvconnector.handshake_client import zmq_host
from kvconnector.handshake_msgs import Poke
from kvconnector.peers import Address

logger = logging.getLogger(__name__)

_MAX_SOCKETS = 64  # D side channels kept connected; the least recently poked goes first
_POKE = msgspec.msgpack.encode(Poke())


class Poker:
    def __init__(self) -> None:
        self._socks: OrderedDict[Address, zmq.Socket] = OrderedDict()
        self.sent = 0
        self.dropped = 0

    def poke(self, addr: Address) -> None:
        """Tell D's side channel at `addr` (host, port) that a WRITE into it is on its way."""
        try:
            self._sock(addr).send(_POKE, zmq.NOBLOCK)
            self.sent += 1
        except zmq.ZMQError as e:
            self.dropped += 1
            logger.debug("poke to %s:%d dropped (%s)", addr[0], addr[1], e)

    def _sock(self, addr: Address) -> zmq.Socket:
        sock = self._socks.pop(addr, None)
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 16)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.IPV6, ":" in addr[0])
            sock.connect(f"tcp://{zmq_host(addr[0])}:{addr[1]}")
            while len(self._socks) >= _MAX_SOCKETS:
                self._socks.popitem(last=False)[1].close()
        self._socks[addr] = sock
        return sock

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()
