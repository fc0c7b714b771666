"""A vLLM user's tools against one colocated server started with a copied `vllm serve` line
(issue 32): prompt logprobs (echo + logprobs, vLLM's prompt_logprobs) equal transformers' at
every position, through chunked prefill and a prompt the prefix cache holds; lm-eval's `hf`
backend and `local-completions` on our server agree item by item; /tokenizer_info;
usage.prompt_tokens_details.cached_tokens; no kv_* series without a connector; and the vLLM
flag table of docs/vllm.md: each honoured flag does what the table says, each no-op is
accepted, each refused one exits 2 naming it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from pd_harness import TEST_ENV

from engine.server import vllm_flags
from engine.server.cli import add_serve_args, config_from_args
from pdserve.launcher import ServerProcess, launch_server

PROMPT = [3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73]
TEMPLATE = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
GPU_FRACTION = 1e-5  # of the host's RAM: a few blocks of the tiny model


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("vllm-flags")
    (d / "tpl.jinja").write_text(TEMPLATE)
    gen = d / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    return {"template": str(d / "tpl.jinja"), "gen": str(gen)}


@pytest.fixture(scope="module")
def server(tiny_model: str, files: dict[str, str]) -> ServerProcess:
    s = launch_server(
        tiny_model, "--dtype", "float32", "--max-model-len", "512", "--block-size", "4",
        "--max-num-batched-tokens", "8", "--served-model-name", "first", "second",
        "--gpu-memory-utilization", str(GPU_FRACTION), "--chat-template", files["template"],
        "--generation-config", files["gen"], "--uvicorn-log-level", "warning",
        "--enable-prefix-caching", "--enforce-eager", "--trust-remote-code",
        "--disable-log-requests", "--disable-log-stats", "--enable-chunked-prefill",
        "--swap-space", "4", "--pipeline-parallel-size", "1", "--kv-cache-dtype", "auto",
        "--log-level", "warning", env=TEST_ENV)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(tiny_model: str) -> list[float]:
    """transformers' logprob of each prompt token after the first."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        lp = model(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
    return [lp[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]


def _post(server: ServerProcess, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_logprobs_equal_transformers_through_chunks_and_cache_hits(server, reference):
    # block 4 and 8 tokens a step: the prompt is prefilled in chunks; the second request's
    # blocks are all in the prefix cache, and its logprobs are computed all the same
    for _ in range(2):
        out = _post(server, "/v1/completions", {"model": "second", "prompt": PROMPT,
                                                "echo": True, "logprobs": 1, "max_tokens": 1})
        lps = out["choices"][0]["logprobs"]
        assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
        got = lps["token_logprobs"][1:len(PROMPT)]
        assert max(abs(a - b) for a, b in zip(got, reference, strict=True)) < 1e-4
        assert all(len(t) >= 1 for t in lps["top_logprobs"][1:])


def test_vllm_prompt_logprobs_field(server, reference):
    out = _post(server, "/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 2,
                                            "max_tokens": 1})
    plp = out["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(PROMPT)
    for i, pos in enumerate(plp[1:], 1):
        entry = pos[str(PROMPT[i])]
        assert abs(entry["logprob"] - reference[i - 1]) < 1e-4 and entry["rank"] >= 1
        assert sorted(e["rank"] for t, e in pos.items() if t != str(PROMPT[i]))[:2] == [1, 2]
    chat = _post(server, "/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}],
                                                 "prompt_logprobs": 0, "max_tokens": 1})
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1


def test_cached_tokens_in_usage(server):
    body = {"prompt": PROMPT[:13], "max_tokens": 1}
    _post(server, "/v1/completions", body)
    usage = _post(server, "/v1/completions", body)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 12  # 3 full blocks of 4


def test_tokenizer_info_and_no_transfer_series_without_connector(server):
    info = httpx.get(server.url + "/tokenizer_info", timeout=10).json()
    assert info["chat_template"] == TEMPLATE and info["eos_token"] and info["bos_token"]
    assert info["model_max_length"] == 512
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert "pdserve:kv_push" not in text and "pdserve:kv_transfer" not in text
    assert "pdserve:num_requests_running" in text


# ---- the flag table --------------------------------------------------------------------


def test_honoured_flags_do_what_the_table_says(server, tiny_model: str):
    names = [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]]
    assert names == ["first", "second"]  # --served-model-name first second
    tokens = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "x"}]})
    detok = _post(server, "/detokenize", {"tokens": tokens["tokens"]})["prompt"]
    assert "[user:x]" in detok
    out = _post(server, "/v1/completions", {"model": "first", "prompt": PROMPT[:5],
                                            "ignore_eos": True})
    assert out["usage"]["completion_tokens"] == 3  # --generation-config: max_new_tokens 3
    stats = httpx.get(server.url + "/engine_stats", timeout=10).json()
    import psutil  # --gpu-memory-utilization: that fraction of this device's memory

    from engine.models import load_arch

    a = load_arch(tiny_model)
    per_block = a.num_layers * 2 * 4 * a.num_kv_heads * a.head_dim * 4  # block 4, float32
    expected = int(GPU_FRACTION * psutil.virtual_memory().total) // per_block
    assert abs(stats["num_kv_blocks"] - expected) <= 1, (stats["num_kv_blocks"], expected)


def _parse(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser(prog="pdserve serve")
    add_serve_args(parser)
    return parser.parse_args(argv)


def test_prefix_caching_flags_and_table_in_docs(tiny_model: str):
    assert config_from_args(_parse([tiny_model, "--no-enable-prefix-caching"])) \
        .enable_prefix_caching is False
    assert config_from_args(_parse([tiny_model, "--enable-prefix-caching"])) \
        .enable_prefix_caching is True
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "vllm.md")
    with open(doc, encoding="utf-8") as f:
        assert vllm_flags.markdown_table() in f.read()


@pytest.mark.parametrize("flag", [f for f in vllm_flags.FLAGS if f.kind != vllm_flags.HONOURED],
                         ids=lambda f: f.name)
def test_no_op_accepted_and_refused_exit_2_naming_it(tiny_model: str, flag, capsys):
    value = [] if flag.metavar is None else ["bogus-value"]
    if flag.kind == vllm_flags.NO_OP:
        ok = [] if flag.metavar is None else [flag.allowed[0] if flag.allowed else "1"]
        _parse([tiny_model, flag.name, *ok])  # accepted
        if not flag.allowed:
            return
    with pytest.raises(SystemExit) as exc:
        _parse([tiny_model, flag.name, *value])
    assert exc.value.code == 2
    assert flag.name in capsys.readouterr().err


def test_a_refused_flag_ends_the_process_with_status_2(tiny_model: str):
    r = subprocess.run([sys.executable, "-m", "engine.server", tiny_model, "--quantization",
                        "awq"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--quantization" in r.stderr


def test_lm_eval_referee_hf_against_local_completions(server, tiny_model: str, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # a local task: no hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from pdserve.bench.lm_eval_referee import referee

    result = referee(tiny_model, server.url, "first", items=6)
    assert result["requests"] == 24
    assert result["max_abs_loglikelihood_diff"] < 1e-3
    assert result["hf_acc"] == result["pdserve_acc"]
