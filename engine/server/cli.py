"""`pdserve serve MODEL …` (also `python -m engine.server`): one engine behind the
OpenAI-compatible HTTP API. `pdserve prefill` / `pdserve decode` reuse `add_serve_args` and
`serve_main(args, role_defaults=…)` with their connector defaults.

Lifecycle (all on one event loop in the main thread):
  start AsyncLLM (spawns the EngineCore process) → serve HTTP → on SIGTERM/SIGINT: new
  requests get 503 and the listening socket closes, in-flight requests get up to
  --drain-timeout seconds, then AsyncLLM shuts down (terminating the EngineCore) → exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import uvloop

from engine import stackdump
from engine.config import EngineConfig
from engine.connector_registry import spec_for
from engine.dp.config import local_ranks, rank_config
from engine.server.app import DEFAULT_MAX_BODY_BYTES, ServerSettings, build_app
from engine.server.metrics import ServerMetrics
from engine.server.vllm_flags import (
    add_vllm_args,
    chat_template,
    generation_defaults,
    kv_cache_gib,
    tool_call_parser,
)
from engine.startup import parse_stage_timeout
from engine.threads import apply_thread_defaults

if TYPE_CHECKING:
    from engine.server.uvicorn_server import ServerCompanion

logger = logging.getLogger("pdserve.server")

# Engine flags whose argparse default is None ("not given") so role defaults can fill them.
_ENGINE_FLAGS = (
    "dtype", "device", "seed", "served_model_name", "block_size", "num_kv_blocks",
    "kv_cache_memory_gib", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
    "tensor_parallel_size", "enable_prefix_caching",
    *("data_parallel_size", "data_parallel_rank", "data_parallel_external_lb",
      "data_parallel_lockstep"),
    "heartbeat_timeout_s", "step_timeout_s", "startup_stage_timeout_s", "kv_events_config",
)


def _stage_timeout(text: str) -> float | dict[str, float]:
    try:
        return parse_stage_timeout(text)
    except ValueError as e:  # argparse prints this message as the usage error
        raise argparse.ArgumentTypeError(str(e)) from None


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve serve` (docs/design.md §3). Engine flags default to None, i.e. to
    EngineConfig's defaults."""
    parser.add_argument("model", metavar="MODEL",
                        help="local Hugging Face model directory, a llama .gguf file, or an "
                             "alias of a packaged model (smollm2)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY") or None,
                        help="require 'Authorization: Bearer KEY' on every route but "
                             "/health: /v1/*, /metrics, /engine_stats, /kv_transfer/info, "
                             "/tokenize, /debug/* (default: $PDSERVE_API_KEY)")
    parser.add_argument("--public-metrics", action="store_true",
                        help="serve /metrics without the API key (for a Prometheus scraper "
                             "that holds no key); off by default, since the counters reveal "
                             "load and traffic")
    parser.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                        help="the model's name in the API (the first is listed first; every "
                             "one is accepted)")
    parser.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16",
                                                          "float16"])
    parser.add_argument("--device", default=None, help="cpu or cuda")
    parser.add_argument("--block-size", type=int, default=None)
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--num-kv-blocks", type=int, default=None)
    cache.add_argument("--kv-cache-memory-gib", type=float, default=None)
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                        action="store_false", default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    add_dp_args(parser)
    parser.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                        help='e.g. \'{"kv_connector": NAME, "kv_role": …}\' (NAME: '
                             'a registered connector)')
    parser.add_argument("--kv-events-config", default=None, metavar="JSON",
                        help="publish prefix-cache events over ZeroMQ, as vLLM does: "
                        '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
                        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' '
                        "(each data-parallel rank at port + rank; off by default)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--kv-secret", default=None,
                        help="shared secret of the KV path (or PDSERVE_KV_SECRET); see "
                             "docs/security.md")
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get after SIGTERM")
    add_deadline_args(parser)
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_vllm_args(parser)


def add_deadline_args(parser: argparse.ArgumentParser) -> None:
    """Deadlines on waits that cross a process (engine/core/liveness.py, startup.py)."""
    parser.add_argument("--heartbeat-timeout", dest="heartbeat_timeout_s", type=float,
                        default=None, metavar="S",
                        help="an EngineCore or tensor-parallel worker silent this long (stopped, "
                             "frozen) fails the engine: its requests end with an error and "
                             "/health answers 503 naming it (default: 30)")
    parser.add_argument("--step-timeout", dest="step_timeout_s", type=float, default=None,
                        metavar="S", help="a model step that has not returned after this long "
                                          "is stuck and fails the engine (default: 900)")
    parser.add_argument("--startup-stage-timeout", dest="startup_stage_timeout_s",
                        type=_stage_timeout, default=None, metavar="S|STAGE=S,...",
                        help="deadline of every start-up stage, or of the stages named "
                             "(default: per stage, 60-1500 s); a stage past it ends the server "
                             "with a non-zero exit")


def add_dp_args(parser: argparse.ArgumentParser) -> None:
    """Data-parallel flags (engine/dp/, docs/design.md §9)."""
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                        help="EngineCore processes behind this server (load-balanced)")
    parser.add_argument("--data-parallel-external-lb", action="store_true", default=None,
                        help="run only rank --data-parallel-rank's engine; balance outside")
    parser.add_argument("--data-parallel-rank", type=int, default=None,
                        help="this server's rank with --data-parallel-external-lb")
    parser.add_argument("--data-parallel-lockstep", action="store_true", default=None,
                        help="engines step together in request waves (models whose forward "
                             "pass is collective across ranks)")


def _kv_transfer_dict(args: argparse.Namespace,
                      role_defaults: Mapping[str, Any]) -> dict[str, Any] | None:
    """Role defaults, overridden by the user's JSON; --kv-host/--kv-port (role flags) fill
    kv_host/kv_port only where the JSON has none."""
    base = role_defaults.get("kv_transfer_config")
    merged: dict[str, Any] = dict(base) if base else {}
    if args.kv_transfer_config:
        try:
            user = json.loads(args.kv_transfer_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-transfer-config is not valid JSON: {exc}") from exc
        if not isinstance(user, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")
        extra = {**merged.get("kv_connector_extra_config", {}),
                 **user.get("kv_connector_extra_config", {})}
        merged.update(user)
        if extra:
            merged["kv_connector_extra_config"] = extra
    for flag in ("kv_host", "kv_port"):
        value = getattr(args, flag, None)
        if value is not None and merged and flag not in merged:
            merged[flag] = value
    secret = getattr(args, "kv_secret", None)
    if secret and merged:
        merged["kv_connector_extra_config"] = {**merged.get("kv_connector_extra_config", {}),
                                               "kv_secret": secret}
    return merged or None


def config_from_args(args: argparse.Namespace,
                     role_defaults: Mapping[str, Any] | None = None) -> EngineConfig:
    """EngineConfig from parsed flags: given flags > role defaults > EngineConfig defaults."""
    role_defaults = dict(role_defaults or {})
    kwargs: dict[str, Any] = {}
    for name in _ENGINE_FLAGS:
        value = getattr(args, name, None)
        if value is None:
            value = role_defaults.get(name)
        if value is not None:
            kwargs[name] = value
    names = kwargs.get("served_model_name")
    if isinstance(names, (list, tuple)):  # several: the first names the model
        kwargs["served_model_name"] = names[0]
    fraction = getattr(args, "gpu_memory_utilization", None)
    if fraction is not None:
        if args.num_kv_blocks is not None or args.kv_cache_memory_gib is not None:
            raise ValueError("--gpu-memory-utilization excludes --num-kv-blocks and "
                             "--kv-cache-memory-gib")
        kwargs.pop("num_kv_blocks", None)  # a role's default yields to the user's flag
        kwargs["kv_cache_memory_gib"] = kv_cache_gib(fraction, kwargs.get("device"))
    kv = _kv_transfer_dict(args, role_defaults)
    if kv is not None:
        kwargs["kv_transfer_config"] = kv
    config = EngineConfig.from_kwargs(args.model, **kwargs)
    if config.data_parallel_external_lb:  # this server is one rank: its KV engine id says so
        config = rank_config(config, int(config.data_parallel_rank or 0))
    return config


def kv_transfer_info(config: EngineConfig) -> dict[str, Any] | None:
    """Static part of GET /kv_transfer/info; a live engine may override fields it resolved
    at start-up (an auto-generated engine id, an ephemeral side-channel port)."""
    kv = config.kv_transfer_config
    if kv is None:
        return None
    spec = spec_for(config)
    assert spec is not None
    tp_size = config.tensor_parallel_size
    ranks = _dp_rank_configs(config)
    first = ranks[0].kv_transfer_config

    def tp_ports(rank_port: int) -> list[int]:  # the connector's layout below a DP rank's port
        return [spec.side_channel_port(rank_port, 0, t, tp_size) for t in range(tp_size)]

    info = {
        "engine_id": first.engine_id, "kv_host": first.kv_host, "kv_port": first.kv_port,
        "tp_size": tp_size, "block_size": config.block_size,
        "kv_ports": tp_ports(first.kv_port),  # TP rank r's side channel; [kv_port] at TP 1
        "kv_role": kv.kv_role, "kv_connector": kv.kv_connector,
    }
    if len(ranks) > 1:  # data parallel: every rank's own side channels (top level: rank 0)
        info["data_parallel_ranks"] = [
            {"rank": r.data_parallel_rank, "engine_id": r.kv_transfer_config.engine_id,
             "kv_host": r.kv_transfer_config.kv_host, "kv_port": r.kv_transfer_config.kv_port,
             "kv_ports": tp_ports(r.kv_transfer_config.kv_port)}
            for r in ranks]
    return info


def _dp_rank_configs(config: EngineConfig) -> list[EngineConfig]:
    """The config of every data-parallel engine this server runs (just `config` without DP)."""
    if config.data_parallel_size > 1 and not config.data_parallel_external_lb:
        return [rank_config(config, r) for r in local_ranks(config)]
    return [config]


def check_side_channel_ports(config: EngineConfig) -> None:
    """With a given --kv-port, every rank's side channel (where the connector's port layout
    puts data-parallel rank d's tensor-parallel rank t) must be able to bind now: a taken one
    is a ValueError naming the port and the rank, before any engine starts (not an engine
    core's bind error after its siblings started)."""
    kv = config.kv_transfer_config
    spec = spec_for(config)
    if kv is None or spec is None or not kv.kv_port:
        return  # ephemeral ports: chosen free by each side channel
    tp_size = config.tensor_parallel_size
    ranks = _dp_rank_configs(config)
    for rank in ranks:
        rkv = rank.kv_transfer_config
        assert rkv is not None
        for tp_rank in range(tp_size):
            port = spec.side_channel_port(rkv.kv_port, 0, tp_rank, tp_size)
            try:
                bind_socket(rkv.kv_host, port).close()
            except OSError as exc:
                who = ([f"data-parallel rank {rank.data_parallel_rank}"] if len(ranks) > 1
                       else []) + ([f"tensor-parallel rank {tp_rank}"] if tp_size > 1 else [])
                raise ValueError(
                    f"{', '.join(who) or 'the engine'}: KV side-channel port {port} on "
                    f"{rkv.kv_host} cannot be bound ({exc.strerror or exc}); --kv-port "
                    f"{kv.kv_port} puts each rank's side channel at kv_port + data-parallel "
                    "rank * tensor_parallel_size + tensor-parallel rank: free the port or "
                    "choose another --kv-port") from None


def serve_main(args: argparse.Namespace, *, role_defaults: Mapping[str, Any] | None = None,
               companions: Sequence[ServerCompanion] = ()) -> int:
    """Entry point of `pdserve serve` (and of the P/D roles). Returns the exit status.
    `companions` start once the server listens and stop when it begins to drain."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stackdump.install()
    # Before torch loads here and before the EngineCore (and its TP workers) are spawned:
    # OpenMP workers that sleep soon after a region, so engines sharing cores do not spin.
    if chosen := apply_thread_defaults():
        logger.info("OpenMP defaults (no wait policy given): %s", chosen)
    try:
        config = config_from_args(args, role_defaults)
        from engine.models import load_arch

        load_arch(config.model)  # an unusable model is a one-line error, before any process
        check_side_channel_ports(config)
        settings = ServerSettings(api_key=args.api_key, public_metrics=args.public_metrics,
                                  max_request_body_bytes=args.max_request_body_bytes,
                                  kv_transfer_info=kv_transfer_info(config),
                                  kv_spec=spec_for(config),
                                  served_aliases=tuple((args.served_model_name or [])[1:]),
                                  chat_template=chat_template(args.chat_template),
                                  tool_call_parser=tool_call_parser(
                                      args.enable_auto_tool_choice, args.tool_call_parser),
                                  default_sampling=generation_defaults(args.generation_config,
                                                                       config.model))
        if args.drain_timeout < 0:
            raise ValueError("--drain-timeout must be non-negative")
    except ValueError as exc:
        print(f"pdserve serve: error: {exc}", file=sys.stderr)
        return 2
    with _exit_on_signal():
        try:
            # libuv loop: less per-request cost
            code = uvloop.run(_serve(config, settings, args, companions))
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception:
            logger.exception("pdserve serve failed")
            return 1
        _exit_process(code)
    return 0  # interrupted (SIGTERM/SIGINT) while starting: an orderly stop


def _exit_process(code: int) -> NoReturn:
    """The server has stopped in order (engine shut down, sockets closed): run the atexit
    handlers (finalizers, log flushes), then exit without the interpreter's teardown of every
    module — a garbage collection of the HTTP stack's objects that took ~1 s of every stop."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


@contextlib.contextmanager
def _exit_on_signal() -> Generator[None, None, None]:
    """Before uvicorn owns the signals (engine start-up): SIGTERM unwinds like Ctrl-C, so the
    engine started so far is shut down by the `finally` blocks instead of being orphaned."""

    def raise_interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    except KeyboardInterrupt:
        logger.info("interrupted during start-up; exiting")
    finally:
        signal.signal(signal.SIGTERM, previous)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it: without it, streamed chunks on a keep-alive
    # connection wait for the client's delayed ACK (~40 ms) under Nagle's algorithm.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock  # not inheritable: the EngineCore child never holds the port


def start_engine(config: EngineConfig, metrics: ServerMetrics) -> Any:
    from engine.frontend.async_llm import AsyncLLM

    return AsyncLLM.from_config(config, multiprocess=True, stat_loggers=[metrics.record])


async def _serve(config: EngineConfig, settings: ServerSettings,
                 args: argparse.Namespace, companions: Sequence[ServerCompanion] = ()) -> int:
    from engine.server.uvicorn_server import DrainingServer

    # Bind before the (slow) engine start: a taken port fails at once, and clients polling
    # /health see "connection refused" until the app really serves.
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", args.host, args.port, exc)
        return 1
    metrics = ServerMetrics(config.model_name, engine_indexes=local_ranks(config),
                            with_transfer=settings.kv_spec is not None, kv_spec=settings.kv_spec)
    try:
        engine = start_engine(config, metrics)
    except BaseException:
        sock.close()
        raise
    try:
        accepted = (config.model,) if config.served_model_name else ()
        app = build_app(engine, model_name=config.model_name, accepted_model_names=accepted,
                        settings=settings, metrics=metrics)
        server = DrainingServer(app, host=args.host, port=args.port,
                                drain_timeout=args.drain_timeout,
                                log_level=args.uvicorn_log_level or args.log_level,
                                access_log=args.access_log,
                                on_drain_deadline=app.state.ctx.abort_all,
                                companions=companions)
        logger.info("serving %s on http://%s:%d", config.model_name, args.host,
                    sock.getsockname()[1])
        try:
            await server.serve(sockets=[sock])
        finally:
            await server.stop_companions()  # also when serving failed: a no-op if stopped
        # Requests cancelled by the drain backstop queued their aborts; let them reach the
        # core before it is told to stop (it would otherwise wait for them).
        await asyncio.sleep(0.1)
        return 0 if server.started else 1
    finally:
        sock.close()
        # Already exiting: a further SIGTERM must not interrupt the engine's shutdown.
        with contextlib.suppress(ValueError):  # not the main thread
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        logger.info("shutting down the engine")
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.server",
                                     description="OpenAI-compatible pdserve engine server")
    add_serve_args(parser)
    return serve_main(parser.parse_args(argv))
