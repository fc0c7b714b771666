"""Two "nodes" in network namespaces (scripts/netns_two_node.sh) and the two-host launch
scripts (scripts/launch_{prefill,decode,proxy}.sh).

The namespace test runs the real script: P in one namespace, D and the proxy in the other,
UCX over TCP on the veth pair; the script itself checks answers against a colocated
reference and that the KV crossed the veth. It is skipped only where `ip netns add` is not
permitted, with the probe's error as the reason.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
NETNS = SCRIPTS / "netns_two_node.sh"
SCRIPT_TIMEOUT_S = 240
EXIT_SKIP = 77


def _netns_probe() -> str | None:
    """None when `ip netns add` works here; else why not (the probe's stderr)."""
    if shutil.which("ip") is None:
        return "no 'ip' command (iproute2 is not installed)"
    name = f"pdserve-probe-{os.getpid()}"
    add = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True,
                         timeout=30)
    if add.returncode != 0:
        return f"'ip netns add' is not permitted: {add.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return None


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          timeout=30).stdout


def _run_bounded(argv: list[str], timeout: float, **kw) -> tuple[int, str]:
    """Run argv; past the timeout send SIGTERM (the script's trap tears down), then KILL."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kw)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"{argv[0]} ran past {timeout}s; output:\n{out}")
    return proc.returncode, out


def _assert_torn_down(out: str, marker: str) -> None:
    """The trap removed the namespaces the run created (named in its output) and every
    process whose command line holds ``marker``."""
    leftovers = [line for line in _namespaces().splitlines()
                 if line.startswith(("pdserve-p-", "pdserve-d-")) and line.split()[0] in out]
    assert not leftovers, f"namespaces left behind: {leftovers}"
    procs = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any(marker in arg for arg in p.info["cmdline"] or ()):
            procs.append((p.info["pid"], p.info["cmdline"][:4]))
    assert not procs, f"processes left behind: {procs}"


@pytest.fixture
def netns_allowed() -> None:
    reason = _netns_probe()
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize(("tp", "etcd"), [(1, False), (2, True)], ids=["tp1", "tp2-etcd"])
def test_two_node_over_veth_matches_colocated_and_moves_the_kv(netns_allowed, tiny_model, tp,
                                                              etcd):
    """tp=2: P and D each run two tensor-parallel ranks, every rank its own NIXL agent and
    side channel across the veth. etcd: membership from a real etcd on P's node (--etcd):
    the engines register their veth addresses and every rank's side channel, the proxy runs
    with --discovery alone and routes to what it found there."""
    if etcd and shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server; make test does)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NETNS_TP": str(tp)}
    argv = [str(NETNS), *(["--etcd"] if etcd else []), tiny_model]
    proc_rc, out = _run_bounded(argv, SCRIPT_TIMEOUT_S, env=env)
    print(out)
    assert proc_rc == 0, f"netns_two_node.sh exited {proc_rc}:\n{out}"
    assert "netns_check: all checks passed" in out
    assert "FAIL" not in out
    found = "ok   the proxy found P and D in etcd"
    assert (found in out) == etcd, out
    tag = re.search(r"namespaces pdserve-p-(\d+)", out).group(1)
    _assert_torn_down(out, f"P-{tag}")
    _assert_torn_down(out, f"D-{tag}")


def test_a_failed_start_still_tears_everything_down(netns_allowed, tmp_path):
    broken = tmp_path / "broken-model"  # config.json but no weights or tokenizer
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    rc, out = _run_bounded([str(NETNS), str(broken)], SCRIPT_TIMEOUT_S)
    assert rc == 1, out
    assert "exited during start-up" in out
    assert "logs kept in" in out
    _assert_torn_down(out, str(broken))
    shutil.rmtree(out.split("logs kept in ")[1].split()[0], ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to drop privileges")
def test_netns_script_exits_77_where_namespaces_are_not_permitted(tiny_model: str):
    rc, out = _run_bounded(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            "--inh-caps=-all", str(NETNS), tiny_model], 60)
    assert rc == EXIT_SKIP, out
    assert "not permitted" in out


def _dry_run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("P_", "D_", "PROXY_", "UCX_")) and k not in (
                 "MODEL", "KV_CONNECTOR", "SERVED_MODEL_NAME", "PDSERVE_EXTRA_ARGS",
                 "PDSERVE_API_KEY", "TP", "DISCOVERY")}
    return subprocess.run([str(SCRIPTS / script), *args], capture_output=True, text=True,
                          env={**clean, "PDSERVE": "/bin/true", **env}, timeout=30)


def test_launch_prefill_builds_the_pdserve_command_from_env_and_flags():
    r = _dry_run("launch_prefill.sh", "--dry-run", "--kv-port", "5700", "--", "--num-kv-blocks",
                 "64", MODEL="/models/m", P_HOST="10.1.2.3", P_PORT="9100", UCX_TLS="rc")
    assert r.returncode == 0, r.stderr
    assert shlex.split(r.stdout) == [
        "/bin/true", "prefill", "/models/m", "--host", "10.1.2.3", "--port", "9100",
        "--kv-host", "10.1.2.3", "--kv-port", "5700", "--kv-connector", "NixlPushConnector",
        "--num-kv-blocks", "64"]
    assert "UCX_TLS=rc" in r.stderr  # what UCX may use is recorded in the launch log


def test_launch_decode_binds_everywhere_but_advertises_its_host():
    r = _dry_run("launch_decode.sh", "/models/m", "--host", "10.9.9.9", "--bind", "0.0.0.0",
                 "--engine-id", "D7", "--served-model-name", "llm", "--dry-run",
                 D_HOST="10.0.0.1", PDSERVE_EXTRA_ARGS="--max-model-len 2048")
    assert r.returncode == 0, r.stderr
    assert shlex.split(r.stdout) == [
        "/bin/true", "decode", "/models/m", "--host", "0.0.0.0", "--port", "8200",
        "--kv-host", "10.9.9.9", "--kv-port", "5601", "--kv-connector", "NixlPushConnector",
        "--engine-id", "D7", "--served-model-name", "llm", "--max-model-len", "2048"]


def test_launch_decode_takes_a_tensor_parallel_size():
    r = _dry_run("launch_decode.sh", "/models/m", "--host", "10.9.9.9", "--dry-run", TP="2")
    assert r.returncode == 0, r.stderr
    assert shlex.split(r.stdout)[-2:] == ["--tensor-parallel-size", "2"]
    r = _dry_run("launch_decode.sh", "/models/m", "--host", "10.9.9.9", "--dry-run", "--tp",
                 "1", D_TP="2")
    assert "--tensor-parallel-size" not in r.stdout  # the flag wins over the environment


@pytest.mark.parametrize(("args", "env", "message"), [
    (["/m"], {}, "P_HOST"),
    ([], {"P_HOST": "10.0.0.1"}, "MODEL"),
    (["/m", "--host", "0.0.0.0"], {}, "concrete address"),
    (["/m", "--port", "70000"], {"P_HOST": "h"}, "--port"),
    (["/m", "--kv-port", "8100"], {"P_HOST": "h"}, "must differ"),
    (["/m", "--connector", "Nope"], {"P_HOST": "h"}, "--connector"),
    (["/m", "--bogus"], {"P_HOST": "h"}, "unknown option"),
    (["/m", "--host"], {}, "needs a value"),
    (["/m", "--tp", "0"], {"P_HOST": "h"}, "--tp must be a positive integer"),
    (["/m", "--tp", "2", "--connector", "NixlConnector"], {"P_HOST": "h"},
     "pull mode (NixlConnector) with tensor parallelism is not supported yet"),
    (["/m", "--tp", "2", "--port", "5601"], {"P_HOST": "h"}, "collides with the side-channel"),
])
def test_launch_prefill_rejects_bad_input_with_exit_2(args, env, message):
    r = _dry_run("launch_prefill.sh", "--dry-run", *args, **env)
    assert r.returncode == 2
    assert message in r.stderr
    assert r.stdout == ""


def test_launch_proxy_points_at_both_hosts_in_push_mode():
    r = _dry_run("launch_proxy.sh", "--dry-run", "--", "--request-timeout", "30",
                 P_HOST="10.0.0.1", D_HOST="10.0.0.2", PROXY_HOST="0.0.0.0")
    assert r.returncode == 0, r.stderr
    assert shlex.split(r.stdout) == [
        "/bin/true", "proxy", "--prefill", "http://10.0.0.1:8100", "--decode",
        "http://10.0.0.2:8200", "--mode", "push", "--host", "0.0.0.0", "--port", "8000",
        "--request-timeout", "30"]


def test_launch_proxy_takes_url_lists_and_rejects_bad_urls():
    r = _dry_run("launch_proxy.sh", "--dry-run", "--decode-url", "http://a:1,http://b:2",
                 "--prefill-host", "p", "--mode", "pull")
    assert r.returncode == 0, r.stderr
    assert shlex.split(r.stdout)[2:9] == ["--prefill", "http://p:8100", "--decode", "http://a:1",
                                          "--decode", "http://b:2", "--mode"]
    bad = _dry_run("launch_proxy.sh", "--dry-run", "--prefill-url", "ftp://x", D_HOST="d")
    assert bad.returncode == 2 and "ftp://x" in bad.stderr
    missing = _dry_run("launch_proxy.sh", "--dry-run", P_HOST="p")
    assert missing.returncode == 2 and "D_HOST" in missing.stderr


def test_launch_scripts_register_in_etcd_and_the_proxy_finds_them_there():
    r = _dry_run("launch_prefill.sh", "/m", "--host", "10.0.0.1", "--discovery",
                 "etcd://10.0.0.9:2379", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert shlex.split(r.stdout)[-4:] == ["--discovery", "etcd://10.0.0.9:2379",
                                          "--advertise-host", "10.0.0.1"]
    r = _dry_run("launch_decode.sh", "/m", "--host", "10.0.0.2", "--bind", "0.0.0.0",
                 "--dry-run", DISCOVERY="etcds://10.0.0.9:2379")
    assert r.returncode == 0, r.stderr
    assert shlex.split(r.stdout)[-4:] == ["--discovery", "etcds://10.0.0.9:2379",
                                          "--advertise-host", "10.0.0.2"]
    r = _dry_run("launch_proxy.sh", "--dry-run", "--discovery", "etcd://10.0.0.9:2379")
    assert r.returncode == 0, r.stderr
    assert shlex.split(r.stdout) == [
        "/bin/true", "proxy", "--discovery", "etcd://10.0.0.9:2379", "--mode", "push",
        "--host", "127.0.0.1", "--port", "8000"]
    both = _dry_run("launch_proxy.sh", "--dry-run", "--discovery", "etcd://h:2379", P_HOST="p")
    assert both.returncode == 2 and "--discovery replaces" in both.stderr
    for script, model in (("launch_prefill.sh", ["/m"]), ("launch_proxy.sh", [])):
        bad = _dry_run(script, "--dry-run", *model, "--discovery", "http://h:2379", P_HOST="p")
        assert bad.returncode == 2 and "etcd://HOST:PORT" in bad.stderr, bad.stderr


@pytest.mark.parametrize("script", ["launch_prefill.sh", "launch_decode.sh", "launch_proxy.sh",
                                    "netns_two_node.sh"])
def test_every_script_prints_usage(script):
    r = subprocess.run([str(SCRIPTS / script), "--help"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0
    assert "Usage:" in r.stdout or "usage" in r.stdout.lower()


def test_launch_proxy_passes_the_api_key_but_never_prints_it():
    r = _dry_run("launch_proxy.sh", "--dry-run", P_HOST="p", D_HOST="d",
                 PDSERVE_API_KEY="s3cret-key")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-2:] == ["--api-key", "***"]
    assert "s3cret-key" not in r.stdout + r.stderr
