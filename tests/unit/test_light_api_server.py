"""The API-server process never imports torch: its messages carry no tensors, so paying for
torch's import (~2 s of CPU and ~300 MB per server) buys nothing. Checked in a child process
where importing torch raises: the server's modules import, and what the server does before it
spawns its engine core (the model's arch and tokenizer, the connectors' admission checks)
runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import importlib, importlib.abc, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("the API server imported torch")

    sys.meta_path.insert(0, NoTorch())
    for mod in ("engine.server.app", "engine.server.cli", "engine.frontend.async_llm",
                "engine.client.dp_lb_client", "prefill.cli", "decode.cli", "prefill.role"):
        importlib.import_module(mod)
    from engine.config import EngineConfig
    from engine.connector_registry import kv_params_validator
    from engine.models import load_arch, load_tokenizer

    model = sys.argv[1]
    assert load_arch(model).num_layers > 0
    assert load_tokenizer(model).encode("hello")
    for name in ("NixlPushConnector", "NixlConnector"):
        cfg = EngineConfig(model=model, kv_transfer_config={"kv_connector": name,
                                                            "kv_role": "kv_both"})
        assert kv_params_validator(cfg) is not None
    print("no torch:", "torch" not in sys.modules)
""")


def test_the_api_server_runs_without_importing_torch(tiny_model: str) -> None:
    result = subprocess.run([sys.executable, "-c", CHILD, tiny_model], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no torch: True" in result.stdout
