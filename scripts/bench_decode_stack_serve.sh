#!/bin/bash
# A served A/B of the compiled DecodeStack: one `pdserve serve` of bench-llama at a time,
# with PDSERVE_DECODE_STACK=1 and =0 alternating, two rounds, each loaded by `pdserve bench
# serve` (CONC x 8 requests, 512 random tokens in, 128 out, ignore_eos, CONC at once).
# usage: scripts/bench_decode_stack_serve.sh DTYPE CONC OUTDIR
set -u
dt=$1; conc=$2; out=$3
for r in 1 2; do
  for st in 1 0; do
    PDSERVE_DECODE_STACK=$st .venv/bin/pdserve serve .models/bench-llama --host 127.0.0.1 --port 8391 --dtype $dt > /tmp/serve_$st.log 2>&1 &
    pid=$!
    for i in $(seq 120); do curl -sf http://127.0.0.1:8391/health >/dev/null && break; sleep 1; done
    .venv/bin/pdserve bench serve --base-url http://127.0.0.1:8391 --tokenizer .models/bench-llama --num-prompts $((conc * 8)) --random-input-len 512 --random-output-len 128 --ignore-eos --max-concurrency $conc --num-warmups 2 --disable-tqdm --result-json $out/serve_${dt}_c${conc}_stack${st}_r$r.json > /tmp/serve_bench.log 2>&1
    python3 -c "
import json; d=json.load(open('$out/serve_${dt}_c${conc}_stack${st}_r$r.json'))
print('$dt c$conc stack=$st r$r', {k: round(v, 2) for k, v in d.items() if k in ('median_itl_ms','median_tpot_ms','median_ttft_ms','output_throughput','request_throughput')})"
    kill $pid; wait $pid 2>/dev/null
  done
done
