#!/usr/bin/env bash
# Where P/D push stands, in one run: colocated vs 1P1D pull vs 1P1D push on the same model and
# the same workloads, the KV transfer microbenchmark and the proxy's own overhead.
#
#   scripts/bench_pd.sh [OUT_DIR]        (default bench/results; ~15-20 min on 2 cores)
#   MODEL=smollm2 scripts/bench_pd.sh     (the real model: a .gguf file or alias works too)
#   SCALE=0.25 scripts/bench_pd.sh /tmp/x   (fewer prompts: a smoke run)
#
# Systems (each engine pinned to ONE core with taskset and OMP_NUM_THREADS=1; the proxy and the
# load generator are not pinned and share both cores):
#   colocated  two `pdserve serve` engines (core 0, core 1); `pdserve bench serve` spreads the
#              requests round-robin over both (two --base-url), as a stateless load balancer
#              would: no proxy process in the path
#   pull       `pdserve prefill` (core 0) + `pdserve decode` (core 1), NixlConnector,
#              `pdserve proxy --mode pull`
#   push       same with NixlPushConnector and `pdserve proxy --mode push`
# Workloads (random token-id prompts, ignore_eos, exact lengths). Every system gets the same
# seed for a workload, so the same prompts at the same arrival times: a push/pull comparison
# at "the same load" is then one trace, not two Poisson draws. Seeds differ between the
# workloads, and each system starts fresh, so no prompt is ever a prefix-cache hit:
#   A   1024 input / 64 output tokens, Poisson arrivals at each rate of $RATES
#   mix 90% 64-in/64-out (decode-heavy) + 10% 1024-in/64-out (prefill-heavy) at $MIX_RATE
# Proxy overhead (push deployment, 64-in/8-out, one request at a time, sent about every
#   1/$OVERHEAD_RATE s so each meets an idle deployment): requests alternate one by one
#   between the proxy and the load generator sending the same P and D legs itself
#   (`bench serve --base-url PROXY --pd-prefill-url P --pd-decode-url D`): same P, same D,
#   same legs, no proxy hop. The overhead is the median TTFT difference of consecutive
#   (direct, proxy) pairs, so a drift of the deployment between runs cannot pass for it.
# Disaggregation cost (pull and push, 1024-in/8-out, one request at a time, 0.5/s): requests
#   alternate between the proxy and P serving the same kind of prompt as a plain request, so
#   the paired difference is what disaggregation adds to P's prefill (transfer, D's first
#   step, the proxy): the share of TTFT that pull vs push can change at all.
# Push vs pull side by side (1024-in/8-out, one request at a time, 0.5/s): both deployments
#   up at once, requests alternating between the two proxies: a light-load comparison that
#   phase-to-phase drift of the machine (P's prefill speed moved by 25 % between phases of
#   one run) cannot distort.
# Push at TP=2 vs TP=1 side by side (1024-in/8-out, one request at a time, 0.5/s): a 1P1D push
#   deployment (P on core 0, D on core 1) and a 1P1D push deployment with P and D at
#   --tensor-parallel-size 2 (each rank one thread, not pinned: both cores), both up at once,
#   requests alternating between the two proxies (TP1 first). TP_PAIRED_PROMPTS=0 skips it.
# Push with P at TP=2, D at TP=1 vs TP=1 both, side by side (1024-in/8-out, one request at a
#   time, 0.5/s; docs/design.md §8): the 1P1D push deployment as above and one whose P runs
#   --tensor-parallel-size 2 (ranks not pinned) writing its two head halves into D (core 1),
#   requests alternating (TP1 first). HETERO_PAIRED_PROMPTS=0 skips it. Alone:
#   SYSTEMS="" PAIRED_MODES_PROMPTS=0 TP_PAIRED_PROMPTS=0 scripts/bench_pd.sh OUT_DIR
# Output: $OUT/pd_bench.md (tables, goals), $OUT/pd_bench.png (TTFT/ITL CDFs), raw JSON and
# server logs in $OUT/pd_raw/.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${BIN:-.venv/bin}
MODEL=${MODEL:-.models/bench-llama}
OUT=${1:-bench/results}
RAW=$OUT/pd_raw
SCALE=${SCALE:-1}
RATES=${RATES:-"0.15 0.3 0.5"}
MIX_RATE=${MIX_RATE:-2.0}
MIX_PROMPTS=${MIX_PROMPTS:-80}
SECONDS_PER_RATE=${SECONDS_PER_RATE:-40}   # num-prompts = max(8, rate * this) for workload A
OVERHEAD_PROMPTS=${OVERHEAD_PROMPTS:-60}   # per round, half through the proxy
OVERHEAD_RATE=${OVERHEAD_RATE:-0.8}  # near-periodic (burstiness 50), one request at a time
COST_PROMPTS=${COST_PROMPTS:-30}     # 1024-in/8-out, half through the proxy, half on P alone
PAIRED_MODES_PROMPTS=${PAIRED_MODES_PROMPTS:-40}  # 1024-in/8-out, half pull, half push; 0: skip
TP_PAIRED_PROMPTS=${TP_PAIRED_PROMPTS:-30}  # 1024-in/8-out, half push TP=1, half push TP=2; 0: skip
HETERO_PAIRED_PROMPTS=${HETERO_PAIRED_PROMPTS:-30}  # half push TP=1, half P TP=2 -> D TP=1; 0: skip
GOODPUT=${GOODPUT:-"ttft:2500 tpot:100"}
PORT_BASE=${PORT_BASE:-18100}
NUM_BLOCKS=${NUM_BLOCKS:-2048}
SYSTEMS=${SYSTEMS-"colocated pull push"}  # empty: only the side-by-side runs
export OMP_NUM_THREADS=1

mkdir -p "$RAW/logs"
rm -f "$RAW"/*.json "$RAW"/loadavg.txt
PIDS=()

log() { echo "[bench_pd $(date +%H:%M:%S)] $*" >&2; }
loadavg() { echo "$1 $(cut -d' ' -f1-3 /proc/loadavg)" >> "$RAW/loadavg.txt"; }
scaled() { "$BIN/python" -c "import sys; print(max(int(sys.argv[3]), round(float(sys.argv[1]) * float(sys.argv[2]))))" "$@"; }

stop_all() {
    # SIGTERM the servers this script started (each shuts its EngineCore down), then SIGKILL
    # whatever of them or their children is left.
    local pid kids=()
    for pid in "${PIDS[@]}"; do
        kids+=($(pgrep -P "$pid" || true))
        kill -TERM "$pid" 2>/dev/null || true
    done
    for _ in $(seq 60); do
        local alive=0
        for pid in "${PIDS[@]}" "${kids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && break
        sleep 0.5
    done
    for pid in "${PIDS[@]}" "${kids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
    PIDS=()
}
# INT/TERM stop the servers and end the script (a trap that returns would let it go on with
# the next phase); EXIT covers every other way out.
trap stop_all EXIT
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM

start() {  # start NAME CORE|- CMD... : in the background, pid in LAST_PID, log in logs/NAME.log
    local name=$1 core=$2; shift 2
    if [ "$core" = "-" ]; then
        "$@" > "$RAW/logs/$name.log" 2>&1 &
    else
        taskset -c "$core" "$@" > "$RAW/logs/$name.log" 2>&1 &
    fi
    LAST_PID=$!
    PIDS+=("$LAST_PID")
}

wait_healthy() {  # wait_healthy URL PID
    for _ in $(seq 360); do
        curl -sf "$1/health" > /dev/null && return 0
        kill -0 "$2" 2>/dev/null || { log "server for $1 died (see $RAW/logs)"; return 1; }
        sleep 0.5
    done
    log "$1 not healthy after 180 s"; return 1
}

bench() {  # bench LABEL JSON_NAME ARGS...
    local label=$1 name=$2; shift 2
    log "bench $label"
    # In the background, waited for: bash runs a trap only once a foreground command has
    # returned, but a signal ends `wait` at once (and stop_all stops the client too).
    "$BIN/pdserve" bench serve --tokenizer "$MODEL" --model bench --disable-tqdm \
        --goodput $GOODPUT --save-detailed --label "$label" --metric-percentiles 50,90,99,99.9 \
        --result-json "$RAW/$name.json" "$@" > "$RAW/logs/bench_$name.txt" 2>&1 &
    PIDS+=($!)
    wait $! || { log "bench $label failed:"; tail -5 "$RAW/logs/bench_$name.txt" >&2; }
    unset 'PIDS[-1]'
    loadavg "$name"
}

SERVE_ARGS=(--served-model-name bench --num-kv-blocks "$NUM_BLOCKS" --max-model-len 2048
            --log-level warning)

start_system() {  # sets TARGET (bench serve target args) and P_URL/D_URL for P/D systems
    local sys=$1 e0=$((PORT_BASE)) e1=$((PORT_BASE + 1)) px=$((PORT_BASE + 2))
    local k0=$((PORT_BASE + 10)) k1=$((PORT_BASE + 11)) a b
    case $sys in
    colocated)
        start colo0 0 "$BIN/pdserve" serve "$MODEL" --port $e0 "${SERVE_ARGS[@]}"; a=$LAST_PID
        start colo1 1 "$BIN/pdserve" serve "$MODEL" --port $e1 "${SERVE_ARGS[@]}"; b=$LAST_PID
        wait_healthy "http://127.0.0.1:$e0" "$a"; wait_healthy "http://127.0.0.1:$e1" "$b"
        TARGET=(--base-url "http://127.0.0.1:$e0" --base-url "http://127.0.0.1:$e1")
        ;;
    pull|push|push_tp2|push_p2d1)
        local conn=NixlConnector mode=$sys pc=0 dc=1 tp=() dtp=()
        [ "$sys" != pull ] && conn=NixlPushConnector mode=push
        # TP=2: rank r's side channel is kv-port + r; the ranks share both cores
        [ "$sys" = push_tp2 ] && { tp=(--tensor-parallel-size 2); dtp=("${tp[@]}"); pc=-; dc=-
                                   k1=$((k0 + 2)); }
        [ "$sys" = push_p2d1 ] && { tp=(--tensor-parallel-size 2); pc=-; k1=$((k0 + 2)); }
        start "${sys}_prefill" $pc "$BIN/pdserve" prefill "$MODEL" --port $e0 --kv-port $k0 \
            --kv-connector $conn --engine-id P0 "${tp[@]}" "${SERVE_ARGS[@]}"; a=$LAST_PID
        start "${sys}_decode" $dc "$BIN/pdserve" decode "$MODEL" --port $e1 --kv-port $k1 \
            --kv-connector $conn --engine-id D0 "${dtp[@]}" "${SERVE_ARGS[@]}"; b=$LAST_PID
        P_URL="http://127.0.0.1:$e0"; D_URL="http://127.0.0.1:$e1"
        wait_healthy "$P_URL" "$a"; wait_healthy "$D_URL" "$b"
        start "${sys}_proxy" - "$BIN/pdserve" proxy --prefill "$P_URL" --decode "$D_URL" \
            --mode "$mode" --port $px --log-level warning; a=$LAST_PID
        wait_healthy "http://127.0.0.1:$px" "$a"
        TARGET=(--base-url "http://127.0.0.1:$px")
        ;;
    *) log "unknown system $sys"; exit 2 ;;
    esac
}

case "$MODEL" in  # a .gguf file or a packaged alias (smollm2) is served as is
*.gguf | smollm2) ;;
*) test -f "$MODEL/config.json" || "$BIN/pdserve" make-tiny-model "$MODEL" --size bench --seed 0 ;;
esac
loadavg start

log "transfer microbenchmark (2048 tokens)"
"$BIN/pdserve" bench transfer --model "$MODEL" --num-tokens 2048 \
    --result-json "$RAW/transfer.json" > "$RAW/logs/transfer.txt" 2>&1 \
    || log "transfer benchmark failed (see $RAW/logs/transfer.txt)"
loadavg transfer

for sys in $SYSTEMS; do
    log "system $sys: starting"
    start_system "$sys"
    seed=100
    for rate in $RATES; do
        n=$(scaled "$rate" "$(scaled "$SCALE" "$SECONDS_PER_RATE" 1)" 8)
        seed=$((seed + 1))
        bench "$sys|A 1024x64|$rate" "${sys}__A_r${rate}" "${TARGET[@]}" \
            --random-input-len 1024 --random-output-len 64 --request-rate "$rate" \
            --num-prompts "$n" --seed $seed
    done
    bench "$sys|mix 90% 64x64 + 10% 1024x64|$MIX_RATE" "${sys}__mix" "${TARGET[@]}" \
        --random-mix "0.9:64:64,0.1:1024:64" --request-rate "$MIX_RATE" \
        --num-prompts "$(scaled "$SCALE" "$MIX_PROMPTS" 10)" --seed 200
    if [ "$sys" != colocated ]; then
        # the proxy first, P second (the report takes the second target as the baseline)
        bench "$sys|disaggregation cost: proxy/P alone interleaved" "${sys}__cost" \
            "${TARGET[@]}" --base-url "$P_URL" \
            --random-input-len 1024 --random-output-len 8 --max-concurrency 1 \
            --request-rate 0.5 --burstiness 50 \
            --num-prompts "$(scaled "$SCALE" "$COST_PROMPTS" 6)" --seed 400
    fi
    if [ "$sys" = push ]; then
        for round in 1 2; do
            bench "push|overhead proxy/direct interleaved|$round" "overhead_$round" \
                "${TARGET[@]}" --pd-prefill-url "$P_URL" --pd-decode-url "$D_URL" \
                --random-input-len 64 --random-output-len 8 --max-concurrency 1 \
                --request-rate "$OVERHEAD_RATE" --burstiness 50 \
                --num-prompts "$(scaled "$SCALE" "$OVERHEAD_PROMPTS" 6)" --seed $((300 + round))
        done
    fi
    log "system $sys: stopping"
    stop_all
done
side_by_side() {  # side_by_side SYS_A SYS_B LABEL JSON_NAME PROMPTS SEED: both up at once
    log "system $1 + $2 side by side: starting"
    start_system "$1"; local first=("${TARGET[@]}")
    PORT_BASE=$((PORT_BASE + 20)) start_system "$2"
    bench "$3|1024x8 one at a time" "$4" "${first[@]}" "${TARGET[@]}" \
        --random-input-len 1024 --random-output-len 8 --max-concurrency 1 \
        --request-rate 0.5 --burstiness 50 --num-prompts "$(scaled "$SCALE" "$5" 6)" --seed "$6"
    log "system $1 + $2 side by side: stopping"
    stop_all
}
# Light-load push vs pull without drift between phases: both deployments up at once (both
# P on core 0, both D on core 1; one request at a time, so only one deployment works at a
# time), requests alternating between the pull proxy (first target) and the push proxy.
if [ "$PAIRED_MODES_PROMPTS" -gt 0 ]; then
    side_by_side pull push "pull vs push side by side" modes_paired "$PAIRED_MODES_PROMPTS" 500
fi
if [ "$TP_PAIRED_PROMPTS" -gt 0 ]; then
    side_by_side push push_tp2 "push TP=1 vs TP=2 side by side" tp_paired "$TP_PAIRED_PROMPTS" 600
fi
if [ "$HETERO_PAIRED_PROMPTS" -gt 0 ]; then
    side_by_side push push_p2d1 "push TP=1 vs P TP=2 -> D TP=1 side by side" hetero_paired \
        "$HETERO_PAIRED_PROMPTS" 700
fi
loadavg end

"$BIN/python" -m pdserve.bench.report --raw "$RAW" --out "$OUT/pd_bench.md" \
    --plot "$OUT/pd_bench.png" --model "$MODEL"
log "wrote $OUT/pd_bench.md and $OUT/pd_bench.png"
