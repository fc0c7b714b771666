"""`pdserve` command line: one entry point, one subcommand per role or tool.

Each subcommand's module is imported only when it runs, so `pdserve proxy` never loads
torch and `pdserve --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, function that adds the arguments, function that runs it, help)
_COMMANDS = {
    "serve": ("engine.server.cli", "add_serve_args", "serve_main", "run an OpenAI server"),
    "prefill": ("prefill.cli", "add_args", "main", "run a prefill (P) server"),
    "decode": ("decode.cli", "add_args", "main", "run a decode (D) server"),
    "proxy": ("proxy.cli", "add_args", "main", "run the P/D proxy"),
    "make-tiny-model": ("engine.models.tiny", "add_args", "main", "write a random tiny model"),
    "demo": ("pdserve.demo", "add_args", "main", "1P1D + proxy on localhost, streamed"),
}
_BENCH = {
    "offline": ("pdserve.bench.offline", "add_args", "main", "LLM.generate vs transformers"),
    "step": ("pdserve.bench.step", "add_args", "main", "step time: ZeroMQ vs in-process"),
    "serve": ("pdserve.bench.serve", "add_args", "main", "load generator for an endpoint"),
    "transfer": ("pdserve.bench.transfer", "add_args", "main", "KV transfer bandwidth"),
    "linear": ("pdserve.bench.linear", "add_args", "main", "decode-size matmuls: MKL vs kernel"),
    "roofline": ("pdserve.bench.roofline", "add_args", "main",
                 "prefill/decode against this CPU's FMA peak and memory bandwidth"),
    "broadcast": ("pdserve.bench.broadcast", "add_args", "main",
                  "TP step message to workers: shm ring vs ZeroMQ"),
    "multiturn": ("pdserve.bench.multiturn", "add_args", "main",
                  "routing policies side by side on multi-turn chat (2P1D, 2P2D)"),
}


def _add(sub: argparse._SubParsersAction, name: str, spec: tuple[str, str, str, str],
         argv: list[str]) -> None:
    module, add_name, main_name, help_text = spec
    parser = sub.add_parser(name, help=help_text)
    parser.set_defaults(_target=(module, main_name))
    # Only the chosen subcommand's module is imported (to add its arguments).
    if name in argv:
        getattr(importlib.import_module(module), add_name)(parser)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, spec in _COMMANDS.items():
        _add(sub, name, spec, argv[:1])
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    for name, spec in _BENCH.items():
        _add(bench, name, spec, argv[1:2] if argv[:1] == ["bench"] else [])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    module, main_name = args._target
    result = getattr(importlib.import_module(module), main_name)(args)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
