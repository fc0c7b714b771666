"""README's Python example runs as written when pasted into a script; without its
`if __name__ == "__main__":` guard the user is told exactly that, quickly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _readme_example() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    (example,) = [b for b in blocks if "LLM(" in b]
    return example


def _run(tmp_path, code: str, timeout: float) -> subprocess.CompletedProcess:
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=timeout)


def test_readme_python_example_runs_as_written(tmp_path):
    done = _run(tmp_path, _readme_example(), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "The capital of France is Paris."


def test_unguarded_script_is_told_to_add_the_main_guard(tmp_path, tiny_model):
    code = textwrap.dedent(f"""
        from engine import LLM, SamplingParams
        llm = LLM(model={tiny_model!r})
        print(llm.generate(["Hello"], SamplingParams(max_tokens=4))[0].outputs[0].text)
    """)
    done = _run(tmp_path, code, timeout=120)
    assert done.returncode != 0
    assert "UnguardedMainError" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr.splitlines()[-1]
