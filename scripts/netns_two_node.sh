#!/usr/bin/env bash
# Two "nodes" on one machine: P in one network namespace, D and the proxy in another, joined
# by a veth pair; UCX restricted to TCP on the veth so the KV really crosses the "network".
#
# Usage: scripts/netns_two_node.sh [--etcd] [MODEL_DIR]
#        (root; MODEL_DIR default: a fresh tiny model)
#
#   namespace pdserve-p-PID  10.77.0.1/24 on veth pdvpPID   P     (launch_prefill.sh)
#                                                           etcd :2379 (--etcd only)
#   namespace pdserve-d-PID  10.77.0.2/24 on veth pdvdPID   D     (launch_decode.sh)
#                                                           proxy (launch_proxy.sh)
#                                                           reference `pdserve serve`
# Then scripts/netns_check.py (inside pdserve-d-PID) sends requests through the proxy and
# checks them against the colocated reference and the transfer counters.
#
# --etcd (or NETNS_ETCD=1): membership from etcd instead of the proxy's static lists. A real
# `etcd` (Debian's etcd-server) runs on P's node, bound to P's veth address; P and D start
# with --discovery etcd://10.77.0.1:2379 --advertise-host <their veth address>, and the
# proxy gets --discovery alone (no --prefill/--decode) and the KV secret, so it routes only
# to registrations signed with it. D's registration and the proxy's watch cross the veth;
# netns_check.py also checks that the proxy found exactly P and D through etcd.
#
# Exit status: 0 all checks passed; 1 a check or a start-up failed; 2 bad usage;
# 77 network namespaces are not permitted here (not root, no CAP_SYS_ADMIN, or no `ip`).
# Whatever happens, the EXIT trap kills every process inside the two namespaces and deletes
# them (deleting a namespace deletes its veth end, and the pair with it). Names carry this
# shell's PID, so parallel runs do not clash; the addresses live only inside the namespaces.
#
# Environment: PDSERVE (the pdserve executable), NETNS_START_TIMEOUT (seconds an engine may
# take to become healthy, default 150), NETNS_KEEP_LOGS=1 (keep the log directory),
# NETNS_UCX_TLS (default tcp) and NETNS_UCX_NET_DEVICES (default: the veth; "any" leaves it
# unset) — the only UCX settings the engines get (for experiments; see docs/two-node.md);
# NETNS_TP (default 1): tensor-parallel size of P and of D (rank r's side channel: port + r).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NAME="netns_two_node"
EXIT_SKIP=77
START_TIMEOUT="${NETNS_START_TIMEOUT:-150}"
TP="${NETNS_TP:-1}"

TAG="$$"
NS_P="pdserve-p-$TAG" NS_D="pdserve-d-$TAG"
VETH_P="pdvp$TAG" VETH_D="pdvd$TAG"            # <= 15 characters (IFNAMSIZ)
IP_P="10.77.0.1" IP_D="10.77.0.2"
P_PORT=8100 P_KV_PORT=5600 D_PORT=8200 D_KV_PORT=5601 PROXY_PORT=8000 REF_PORT=8300
ETCD_PORT=2379 ETCD_PEER_PORT=2380
SERVED="tiny"
UCX_TLS_USED="${NETNS_UCX_TLS-tcp}"
UCX_DEVICES_USED="${NETNS_UCX_NET_DEVICES:-veth}"
ENGINE_FLAGS=(--num-kv-blocks 512 --max-model-len 1024 --log-level info)

log() { echo "$NAME: $*" >&2; }

USE_ETCD="${NETNS_ETCD:-0}"
ARGS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
        --etcd) USE_ETCD=1; shift ;;
        -*) log "unknown option '$1'; usage: $0 [--etcd] [MODEL_DIR]"; exit 2 ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
[[ ${#ARGS[@]} -le 1 ]] || { log "usage: $0 [--etcd] [MODEL_DIR]"; exit 2; }
set -- "${ARGS[@]}"
ETCD_BIN=""
if [[ "$USE_ETCD" == 1 ]]; then
    ETCD_BIN="$(command -v etcd || true)"
    [[ -n "$ETCD_BIN" ]] || { log "--etcd needs the etcd binary (apt-get install etcd-server)"
                              exit 1; }
fi

if [[ -n "${PDSERVE:-}" ]]; then PDSERVE_BIN="$PDSERVE"
elif [[ -x "$ROOT/.venv/bin/pdserve" ]]; then PDSERVE_BIN="$ROOT/.venv/bin/pdserve"
else PDSERVE_BIN="$(command -v pdserve || true)"
fi
[[ -x "$PDSERVE_BIN" ]] || { log "no pdserve executable (set PDSERVE or make install)"; exit 1; }
PYTHON="$(dirname "$PDSERVE_BIN")/python"
[[ -x "$PYTHON" ]] || PYTHON="$(command -v python3)"
export PDSERVE="$PDSERVE_BIN"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/pdserve-netns.XXXXXX")"
CREATED_NS=()

# Kill what runs inside our namespaces (TERM, then KILL after a grace period), delete them.
cleanup() {
    local rc=$? ns pids deadline t0=$SECONDS
    set +e
    trap - EXIT INT TERM
    for ns in "${CREATED_NS[@]}"; do
        pids="$(ip netns pids "$ns" 2>/dev/null)"
        [[ -z "$pids" ]] || kill -TERM $pids 2>/dev/null
    done
    deadline=$((SECONDS + 20))
    for ns in "${CREATED_NS[@]}"; do
        while [[ -n "$(ip netns pids "$ns" 2>/dev/null)" ]] && ((SECONDS < deadline)); do
            sleep 0.2
        done
        pids="$(ip netns pids "$ns" 2>/dev/null)"
        if [[ -n "$pids" ]]; then
            log "killing processes that ignored SIGTERM in $ns: $pids"
            kill -KILL $pids 2>/dev/null
            sleep 0.5
        fi
        ip netns del "$ns" 2>/dev/null || log "could not delete namespace $ns"
    done
    wait 2>/dev/null
    if [[ $rc -ne 0 && $rc -ne $EXIT_SKIP ]]; then
        for f in "$WORK"/*.log; do
            [[ -f "$f" ]] || continue
            echo "----- last lines of $(basename "$f") -----" >&2
            tail -n 40 "$f" >&2
        done
    fi
    if [[ ( $rc -ne 0 && $rc -ne $EXIT_SKIP ) || "${NETNS_KEEP_LOGS:-0}" == 1 ]]; then
        log "logs kept in $WORK"
    else
        rm -rf "$WORK"
    fi
    log "$( ((rc == 0)) && echo PASSED || echo "exit status $rc") after ${SECONDS}s" \
        "(teardown $((SECONDS - t0))s)"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- namespaces and the veth pair -----------------------------------------------------------
if ! command -v ip >/dev/null 2>&1; then
    log "SKIP: no 'ip' command (install iproute2)"
    exit "$EXIT_SKIP"
fi
if ! ip netns add "$NS_P" 2>"$WORK/probe.err"; then
    log "SKIP: 'ip netns add' is not permitted here: $(tr '\n' ' ' <"$WORK/probe.err")"
    exit "$EXIT_SKIP"
fi
CREATED_NS+=("$NS_P")
ip netns add "$NS_D"
CREATED_NS+=("$NS_D")
ip link add "$VETH_P" netns "$NS_P" type veth peer name "$VETH_D" netns "$NS_D"
ip -n "$NS_P" addr add "$IP_P/24" dev "$VETH_P"
ip -n "$NS_D" addr add "$IP_D/24" dev "$VETH_D"
for pair in "$NS_P:$VETH_P" "$NS_D:$VETH_D"; do
    ip -n "${pair%%:*}" link set lo up
    ip -n "${pair%%:*}" link set "${pair#*:}" up
done
log "namespaces $NS_P ($IP_P on $VETH_P) and $NS_D ($IP_D on $VETH_D) are up"

# --- model ----------------------------------------------------------------------------------
MODEL="${1:-}"
if [[ -z "$MODEL" ]]; then
    MODEL="$WORK/tiny-model"
    "$PDSERVE_BIN" make-tiny-model "$MODEL" --arch llama --size tiny --seed 0 \
        >"$WORK/make-model.log" 2>&1
fi
[[ -f "$MODEL/config.json" ]] || { log "$MODEL is not a model directory (no config.json)"; exit 1; }

# --- processes ------------------------------------------------------------------------------
# in_ns NS LOG VAR=VALUE... -- CMD...: run CMD in NS, in the background. The caller's UCX_*
# settings and the launch scripts' variables (P_*, D_*, PROXY_*, MODEL, ...) are dropped so
# that only what this script sets reaches the engines.
SCRUB='^(UCX_[A-Za-z0-9_]+|P_[A-Z_]+|D_[A-Z_]+|PROXY_[A-Z_]+|MODEL|KV_CONNECTOR|TP'
SCRUB+='|SERVED_MODEL_NAME|PDSERVE_EXTRA_ARGS|PDSERVE_API_KEY|PDSERVE_KV_SECRET|DISCOVERY'
SCRUB+='|PDSERVE_ETCD_PASSWORD|[A-Za-z]+_(PROXY|proxy))$'
in_ns() {
    local ns="$1" logf="$2"
    shift 2
    local -a vars=() drop=()
    while [[ "$1" != -- ]]; do [[ -z "$1" ]] || vars+=("$1"); shift; done
    shift
    local v
    for v in $(compgen -e | grep -E "$SCRUB" || true); do drop+=(-u "$v"); done
    [[ -z "$UCX_TLS_USED" ]] || vars=(UCX_TLS="$UCX_TLS_USED" "${vars[@]}")
    ip netns exec "$ns" env "${drop[@]}" OMP_NUM_THREADS=1 "${vars[@]}" "$@" \
        >"$WORK/$logf" 2>&1 &
}

# alive PID: the process runs (an exited child stays a zombie until reaped: not alive).
alive() {
    local state
    state="$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)"
    [[ -n "$state" && "$state" != Z ]]
}

# wait_healthy NS URL PID WHAT: until GET URL/health answers 200 from inside NS.
wait_healthy() {
    local ns="$1" url="$2" pid="$3" what="$4" deadline=$((SECONDS + START_TIMEOUT))
    until ip netns exec "$ns" curl -sf --noproxy '*' -o /dev/null --max-time 2 "$url/health"; do
        alive "$pid" || { log "$what exited during start-up"; exit 1; }
        ((SECONDS < deadline)) || { log "$what not healthy after ${START_TIMEOUT}s"; exit 1; }
        sleep 0.5
    done
    log "$what is healthy at $url"
}

ucx_dev() {  # ucx_dev VETH: the UCX_NET_DEVICES assignment for one side, if any
    case "$UCX_DEVICES_USED" in
        veth) echo "UCX_NET_DEVICES=$1" ;;
        any) ;;
        *) echo "UCX_NET_DEVICES=$UCX_DEVICES_USED" ;;
    esac
}

# P and D share a KV secret (docs/security.md), passed in the environment, never on a
# command line where `ps` would show it; the proxy does not need it.
KV_SECRET="$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')"
DISCOVERY_URL="" PROXY_VARS=(P_HOST="$IP_P" P_PORT="$P_PORT" D_HOST="$IP_D" D_PORT="$D_PORT")
if [[ "$USE_ETCD" == 1 ]]; then
    ETCD_URL="http://$IP_P:$ETCD_PORT"
    in_ns "$NS_P" etcd.log -- "$ETCD_BIN" --name "netns-$TAG" --data-dir "$WORK/etcd" \
        --listen-client-urls "$ETCD_URL" --advertise-client-urls "$ETCD_URL" \
        --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-cluster "netns-$TAG=http://127.0.0.1:$ETCD_PEER_PORT" --log-level warn
    PID_ETCD=$!
    wait_healthy "$NS_D" "$ETCD_URL" "$PID_ETCD" "etcd ($NS_P)"
    DISCOVERY_URL="etcd://$IP_P:$ETCD_PORT"
    PROXY_VARS=(DISCOVERY="$DISCOVERY_URL" PDSERVE_KV_SECRET="$KV_SECRET")
fi
in_ns "$NS_P" prefill.log "$(ucx_dev "$VETH_P")" MODEL="$MODEL" P_HOST="$IP_P" \
    P_PORT="$P_PORT" P_KV_PORT="$P_KV_PORT" P_TP="$TP" PDSERVE_KV_SECRET="$KV_SECRET" \
    DISCOVERY="$DISCOVERY_URL" -- \
    "$ROOT/scripts/launch_prefill.sh" --engine-id "P-$TAG" --served-model-name "$SERVED" \
    -- "${ENGINE_FLAGS[@]}"
PID_P=$!
in_ns "$NS_D" decode.log "$(ucx_dev "$VETH_D")" MODEL="$MODEL" D_HOST="$IP_D" \
    D_PORT="$D_PORT" D_KV_PORT="$D_KV_PORT" D_TP="$TP" PDSERVE_KV_SECRET="$KV_SECRET" \
    DISCOVERY="$DISCOVERY_URL" -- \
    "$ROOT/scripts/launch_decode.sh" --engine-id "D-$TAG" --served-model-name "$SERVED" \
    -- "${ENGINE_FLAGS[@]}"
PID_D=$!
in_ns "$NS_D" reference.log -- "$PDSERVE_BIN" serve "$MODEL" --host 127.0.0.1 \
    --port "$REF_PORT" --served-model-name "$SERVED" "${ENGINE_FLAGS[@]}"
PID_REF=$!

wait_healthy "$NS_D" "http://$IP_P:$P_PORT" "$PID_P" "prefill (P, $NS_P)"
wait_healthy "$NS_D" "http://$IP_D:$D_PORT" "$PID_D" "decode (D, $NS_D)"
wait_healthy "$NS_D" "http://127.0.0.1:$REF_PORT" "$PID_REF" "colocated reference"

in_ns "$NS_D" proxy.log "${PROXY_VARS[@]}" PROXY_HOST="$IP_D" PROXY_PORT="$PROXY_PORT" -- \
    "$ROOT/scripts/launch_proxy.sh" --mode push -- --health-interval 0.5
PID_PROXY=$!
wait_healthy "$NS_D" "http://$IP_D:$PROXY_PORT" "$PID_PROXY" "proxy ($NS_D)"

# --- checks ---------------------------------------------------------------------------------
# In the background + wait, so a TERM to this script runs the trap without waiting for it.
ip netns exec "$NS_D" env -u PDSERVE_API_KEY "$PYTHON" "$ROOT/scripts/netns_check.py" \
    --proxy "http://$IP_D:$PROXY_PORT" --prefill "http://$IP_P:$P_PORT" \
    --decode "http://$IP_D:$D_PORT" --reference "http://127.0.0.1:$REF_PORT" \
    --p-kv-host "$IP_P" --veth "$VETH_D" --model "$SERVED" --tp "$TP" \
    ${DISCOVERY_URL:+--discovery} &
wait $!
