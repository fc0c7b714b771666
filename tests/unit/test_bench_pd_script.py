"""scripts/bench_pd.sh stops at SIGTERM: its servers and its load generator are gone and it
exits at once, instead of carrying on with the next phase (or waiting for the running bench to
end). `pdserve` is a stub here: its servers answer every GET, its `bench serve` never ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from engine.net import free_port

REPO = Path(__file__).resolve().parents[2]

STUB = """#!/usr/bin/env bash
case "$1 $2" in
"bench transfer") exit 0 ;;
"bench serve") echo $$ > "$STUB_DIR/bench.pid"; exec sleep 600 ;;
esac
port=$(echo "$@" | sed -E 's/.*--port ([0-9]+).*/\\1/')
echo $$ >> "$STUB_DIR/servers.pids"
exec "$STUB_PYTHON" -c '
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
' "$port"
"""


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.05)


def _pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def test_sigterm_stops_the_servers_and_the_script_at_once(tmp_path: Path) -> None:
    bin_dir, model = tmp_path / "bin", tmp_path / "model"
    bin_dir.mkdir()
    model.mkdir()
    (model / "config.json").write_text("{}")
    (bin_dir / "pdserve").write_text(STUB)
    (bin_dir / "pdserve").chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    env = {**os.environ, "BIN": str(bin_dir), "MODEL": str(model), "SYSTEMS": "colocated",
           "PORT_BASE": str(free_port(count=2)), "PAIRED_MODES_PROMPTS": "0",
           "TP_PAIRED_PROMPTS": "0", "STUB_DIR": str(tmp_path), "STUB_PYTHON": sys.executable}
    script = subprocess.Popen(["bash", str(REPO / "scripts/bench_pd.sh"), str(tmp_path / "out")],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True)
    started = []
    try:
        _wait(lambda: (tmp_path / "bench.pid").exists(), 60, "the first bench to run")
        started = [*_pids(tmp_path / "servers.pids"), *_pids(tmp_path / "bench.pid")]
        assert len(started) == 3  # two colocated engines and the load generator
        script.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        rc = script.wait(timeout=20)
        assert rc == 143, script.stderr.read().decode()
        assert time.monotonic() - stopped < 10
        _wait(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status()
                              != psutil.STATUS_ZOMBIE for p in started), 5, "the servers to go")
        assert "system colocated: stopping" not in script.stderr.read().decode()
    finally:
        for pid in [script.pid, *started]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        script.wait()
