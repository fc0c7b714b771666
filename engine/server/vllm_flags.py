"""`vllm serve` flags that users copy into `pdserve serve` lines: each is honoured, accepted
as a documented no-op where it cannot matter here, or refused (exit 2) naming the flag and
why. Never silently ignored. `FLAGS` is the table docs/vllm.md shows (`python -m
engine.server.vllm_flags` prints it) and tests/integration/test_vllm_flags.py runs.

Flags vLLM and pdserve share with one meaning (--host, --port, --api-key, --dtype, --seed,
--max-model-len, --max-num-seqs, --max-num-batched-tokens, --block-size,
--tensor-parallel-size, --data-parallel-size, --kv-transfer-config, --served-model-name,
--no-enable-prefix-caching) are defined in engine/server/cli.py.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any

HONOURED, NO_OP, REFUSED = "honoured", "no-op", "refused"


@dataclass(frozen=True)
class Flag:
    name: str
    kind: str  # HONOURED, NO_OP or REFUSED
    what: str  # what it does here, or why it is a no-op or refused
    metavar: str | None = None  # takes a value; None: a switch
    allowed: tuple[str, ...] = ()  # values accepted as a no-op (others are refused)


FLAGS: tuple[Flag, ...] = (
    Flag("--enable-prefix-caching", HONOURED,
         "prefix caching on (the default; `--no-enable-prefix-caching` turns it off)"),
    Flag("--gpu-memory-utilization", HONOURED,
         "the fraction of this device's memory the KV cache may take (GPU: its total "
         "memory; CPU: the host's RAM); excludes --num-kv-blocks and --kv-cache-memory-gib",
         "F"),
    Flag("--chat-template", HONOURED,
         "a Jinja chat template (a file, or the template itself) replacing the model's",
         "TEMPLATE"),
    Flag("--generation-config", HONOURED,
         "`auto`: the model's generation_config.json sets the default temperature, top_p, "
         "top_k, min_p, repetition_penalty and max_tokens of requests that give none; a "
         "folder: its generation_config.json does; `vllm` (the default here): the "
         "server's own defaults", "auto|vllm|FOLDER"),
    Flag("--uvicorn-log-level", HONOURED, "the HTTP server's log level", "LEVEL"),
    Flag("--enforce-eager", NO_OP, "no CUDA graphs are ever captured: always eager"),
    Flag("--trust-remote-code", NO_OP,
         "no model code is ever loaded from a model directory: the architectures are built in "
         "(engine/models/families/), so there is no remote code to trust"),
    Flag("--disable-log-requests", NO_OP, "requests are never logged (--access-log logs them)"),
    Flag("--disable-log-stats", NO_OP, "no periodic stats lines are logged: see /metrics"),
    Flag("--enable-chunked-prefill", NO_OP, "prefill is always chunked "
         "(--max-num-batched-tokens per step)"),
    Flag("--swap-space", NO_OP, "a preempted request recomputes; nothing is swapped", "GIB"),
    Flag("--disable-frontend-multiprocessing", NO_OP,
         "the engine core always runs in its own process"),
    Flag("--pipeline-parallel-size", NO_OP, "1 only: larger is refused (no pipeline "
         "parallelism; use --tensor-parallel-size)", "N", ("1",)),
    Flag("--kv-cache-dtype", NO_OP, "`auto` only (the model's dtype); fp8 caches are refused",
         "DTYPE", ("auto",)),
    Flag("--load-format", NO_OP, "`auto` or `safetensors` (what is read); others are refused",
         "FORMAT", ("auto", "safetensors")),
    Flag("--tokenizer-mode", NO_OP, "`auto` only (the model's tokenizer.json)", "MODE",
         ("auto",)),
    Flag("--quantization", REFUSED, "no quantized weights are served (bf16/fp16/fp32 only)",
         "METHOD"),
    Flag("--speculative-config", REFUSED, "no speculative decoding", "JSON"),
    Flag("--enable-lora", REFUSED, "no LoRA adapters"),
    Flag("--lora-modules", REFUSED, "no LoRA adapters", "SPEC"),
    Flag("--enable-auto-tool-choice", HONOURED, "tool_choice `auto` (OpenAI's default with "
         "tools): the model decides, --tool-call-parser reads its calls; without it `auto` is "
         "a 400 (`required`, a named function and `none` need no flag)"),
    Flag("--tool-call-parser", HONOURED, "`hermes` (Qwen2.5, Qwen3: `<tool_call>` blocks) or "
         "`llama3_json` (Llama 3.x JSON calls); any other parser is refused", "NAME"),
    Flag("--tokenizer", REFUSED, "the model directory's own tokenizer is always used",
         "PATH"),
    Flag("--revision", REFUSED, "models are local directories or files: nothing is "
         "downloaded", "REV"),
    Flag("--download-dir", REFUSED, "models are local: nothing is downloaded", "DIR"),
    Flag("--cpu-offload-gb", REFUSED, "weights are never offloaded", "GIB"),
    Flag("--max-lora-rank", REFUSED, "no LoRA adapters", "N"),
)


def _dest(flag: Flag) -> str:
    return "vllm_" + flag.name.removeprefix("--").replace("-", "_")


class _Refuse(argparse.Action):
    """A refused flag (or a no-op flag given a value other than its allowed ones) ends
    argument parsing with exit status 2, naming the flag and why."""

    def __init__(self, *args: Any, flag: Flag, **kwargs: Any) -> None:
        self.flag = flag
        super().__init__(*args, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        f = self.flag
        if f.kind == NO_OP and (not f.allowed or values in f.allowed):
            setattr(namespace, self.dest, values if f.metavar else True)
            return
        given = "" if f.metavar is None else f" {values}"
        raise argparse.ArgumentError(self, f"{f.name}{given} is not supported by pdserve: "
                                           f"{f.what}")


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM compatibility (docs/vllm.md)")
    for f in FLAGS:
        if f.kind == HONOURED:
            continue
        nargs = None if f.metavar else 0
        group.add_argument(f.name, dest=_dest(f), action=_Refuse, flag=f, nargs=nargs,
                           metavar=f.metavar, default=None,
                           help=f"[{f.kind}] {f.what}")
    group.add_argument("--enable-prefix-caching", dest="enable_prefix_caching",
                       action="store_true", default=None, help=FLAGS[0].what)
    group.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                       help=FLAGS[1].what)
    group.add_argument("--chat-template", default=None, metavar="TEMPLATE", help=FLAGS[2].what)
    group.add_argument("--generation-config", default="vllm", metavar="auto|vllm|FOLDER",
                       help=FLAGS[3].what)
    by_name = {f.name: f for f in FLAGS}
    group.add_argument("--enable-auto-tool-choice", action="store_true", default=False,
                       help=by_name["--enable-auto-tool-choice"].what)
    group.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help=by_name["--tool-call-parser"].what)
    group.add_argument("--uvicorn-log-level", default=None,
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help=FLAGS[4].what)


def tool_call_parser(enable_auto: bool, parser: str | None) -> str | None:
    """The parser of tool_choice `auto`, None when `auto` is off. ValueError names the flag."""
    from engine.server.tools import PARSERS

    if parser is not None and parser not in PARSERS:
        raise ValueError(f"--tool-call-parser {parser} is not supported by pdserve: "
                         f"{' or '.join(PARSERS)}")
    if enable_auto and parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser "
                         f"({' or '.join(PARSERS)})")
    return parser if enable_auto else None


def kv_cache_gib(fraction: float, device: str | None) -> float:
    """--gpu-memory-utilization as --kv-cache-memory-gib on `device` (cpu or cuda)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {fraction}")
    if (device or "cpu").startswith("cuda"):
        import torch

        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    else:
        import psutil

        total = psutil.virtual_memory().total
    return fraction * total / (1 << 30)


_GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                    "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                    "max_new_tokens": "max_tokens"}


def generation_defaults(value: str, model: str) -> dict[str, Any]:
    """Default sampling fields of --generation-config (request fields always win)."""
    if value == "vllm":
        return {}
    folder = model if value == "auto" else value
    if value != "auto" and not os.path.isdir(folder):
        raise ValueError(f"--generation-config {value}: not auto, vllm or a folder")
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if value == "auto":
            return {}  # a GGUF file or a directory without one: the server's defaults
        raise ValueError(f"--generation-config {value}: {path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--generation-config: {path} is not readable JSON: {exc}") from None
    return {ours: config[theirs] for theirs, ours in _GENERATION_KEYS.items()
            if isinstance(config.get(theirs), (int, float))
            and not isinstance(config.get(theirs), bool)}


def chat_template(value: str | None) -> str | None:
    """--chat-template: a readable file's contents, else the value itself (as vLLM)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r}: neither a file nor a Jinja template")
    return value


def markdown_table() -> str:
    rows = ["| vLLM flag | here | what it does here |", "|---|---|---|"]
    rows += [f"| `{f.name}{' ' + f.metavar if f.metavar else ''}` | {f.kind} | {f.what} |"
             for f in FLAGS]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
