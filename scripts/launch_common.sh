# Shared by scripts/launch_{prefill,decode,proxy}.sh; sourced, never run.
#
# The sourcing script sets LAUNCH_NAME (its name, for messages) first. Sourcing has no side
# effect beyond defining PDSERVE_ROOT and the functions below. Bad input exits 2 with a
# message on stderr; nothing is started before every value has been checked.

PDSERVE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

die() {
    echo "${LAUNCH_NAME}: error: $*" >&2
    echo "run '${LAUNCH_NAME} --help' for usage" >&2
    exit 2
}

# The pdserve executable: $PDSERVE, else the checkout's .venv/bin/pdserve, else PATH.
find_pdserve() {
    if [[ -n "${PDSERVE:-}" ]]; then
        [[ -x "$PDSERVE" ]] || die "PDSERVE=$PDSERVE is not an executable file"
        echo "$PDSERVE"
    elif [[ -x "$PDSERVE_ROOT/.venv/bin/pdserve" ]]; then
        echo "$PDSERVE_ROOT/.venv/bin/pdserve"
    elif command -v pdserve >/dev/null 2>&1; then
        command -v pdserve
    else
        die "no pdserve found: set PDSERVE, create $PDSERVE_ROOT/.venv (make install), " \
            "or put pdserve on PATH"
    fi
}

# need_value FLAG "$#" — a flag that takes a value was given as the last argument.
need_value() {
    [[ "$2" -ge 2 ]] || die "$1 needs a value"
}

is_port() {
    [[ "$1" =~ ^[0-9]+$ ]] && (( "$1" >= 1 && "$1" <= 65535 ))
}

check_port() {  # check_port NAME VALUE
    is_port "$2" || die "$1 must be a TCP port (1-65535), got '$2'"
}

# check_discovery URL — empty, or an etcd URL that pdserve's --discovery takes.
check_discovery() {
    [[ -z "$1" || "$1" =~ ^etcds?://[^/?#]+$ ]] || \
        die "--discovery must look like etcd://HOST:PORT or etcds://HOST:PORT, got '$1'"
}

# Print the UCX_* variables that pdserve will inherit (one line, to stderr), so the log of
# every launch records which transports UCX was allowed to use.
report_ucx_env() {
    local vars
    vars="$(env | grep -E '^UCX_' | sort | tr '\n' ' ' || true)"
    echo "${LAUNCH_NAME}: UCX environment: ${vars:-<none: UCX picks its transports itself>}" >&2
}

# print_and_exec DRY_RUN CMD... — show the exact command (shell-quoted, the value of
# --api-key masked) and exec it; with DRY_RUN=1 print it to stdout instead and exit 0.
print_and_exec() {
    local dry_run="$1" arg prev="" shown=""
    shift
    for arg in "$@"; do
        if [[ "$prev" == --api-key ]]; then shown+=" ***"; else shown+=" $(printf '%q' "$arg")"; fi
        prev="$arg"
    done
    if [[ "$dry_run" == 1 ]]; then
        echo "${shown# }"
        exit 0
    fi
    echo "${LAUNCH_NAME}: exec${shown}" >&2
    exec "$@"
}

# role_usage ROLE X DEFAULT_PORT DEFAULT_KV_PORT — help text of launch_{prefill,decode}.sh.
role_usage() {
    local role="$1" x="$2" port="$3" kv_port="$4" peer
    if [[ "$role" == prefill ]]; then peer="the decode host (D)"; else peer="the prefill host (P)"; fi
    cat <<USAGE
Usage: ${LAUNCH_NAME} [options] [MODEL_DIR] [-- extra 'pdserve ${role}' flags]

Start the ${role} (${x}) engine of a two-host P/D deployment on THIS host:
  pdserve ${role} MODEL_DIR --host BIND --port PORT --kv-host HOST --kv-port KV_PORT ...

Options (environment variable in brackets; a flag wins):
  --model DIR           local Hugging Face model directory [MODEL]
  --host ADDR           required: this host's address that the proxy and ${peer}
                        reach; the KV side channel binds and advertises it [${x}_HOST]
  --bind ADDR           address the HTTP server binds; default --host, 0.0.0.0 for
                        every interface [${x}_BIND]
  --port N              HTTP port; default ${port} [${x}_PORT]
  --kv-port N           KV side-channel port; default ${kv_port} [${x}_KV_PORT]; with
                        --tp N, rank r listens at KV_PORT + r (open all N ports)
  --tp N                tensor-parallel size (push mode; P and D must use the same N);
                        default 1 [${x}_TP, else TP]
  --engine-id ID        engine id; default random [${x}_ENGINE_ID]
  --connector NAME      NixlPushConnector (push, default) or NixlConnector (pull)
                        [KV_CONNECTOR]
  --served-model-name N model name clients send; default MODEL_DIR [SERVED_MODEL_NAME]
  --discovery URL       register in etcd (etcd://HOST:PORT or etcds://), advertising
                        --host; the proxy then finds this engine itself [DISCOVERY]
  --ucx-tls LIST        UCX transports, e.g. rc,cuda_copy or tcp [UCX_TLS]
  --ucx-net-devices L   UCX devices, e.g. mlx5_0:1 or eth0 [UCX_NET_DEVICES]
  --dry-run             print the pdserve command line and exit
  -h, --help            this help

Extra pdserve flags: after '--', or in PDSERVE_EXTRA_ARGS (split on spaces), e.g.
  -- --num-kv-blocks 4096 --tensor-parallel-size 2
The pdserve executable: \$PDSERVE, else the checkout's .venv/bin/pdserve, else PATH.
Every UCX_* variable in the environment (UCX_TLS, UCX_NET_DEVICES, UCX_IB_GID_INDEX,
UCX_TCP_PORT_RANGE, ...) reaches pdserve unchanged. PDSERVE_API_KEY, if set, is required
from clients (pass the same key to the proxy).
USAGE
}

# launch_role ROLE X DEFAULT_PORT DEFAULT_KV_PORT "$@" — parse flags/env, exec pdserve ROLE.
# X is the environment prefix: P for prefill, D for decode.
launch_role() {
    local role="$1" x="$2" def_port="$3" def_kv_port="$4"
    shift 4
    local host_var="${x}_HOST" bind_var="${x}_BIND" port_var="${x}_PORT"
    local kv_port_var="${x}_KV_PORT" id_var="${x}_ENGINE_ID" tp_var="${x}_TP"
    local model="${MODEL:-}" host="${!host_var:-}" bind="${!bind_var:-}"
    local port="${!port_var:-$def_port}" kv_port="${!kv_port_var:-$def_kv_port}"
    local engine_id="${!id_var:-}" connector="${KV_CONNECTOR:-NixlPushConnector}"
    local served="${SERVED_MODEL_NAME:-}" dry_run=0 tp="${!tp_var:-${TP:-1}}"
    local discovery="${DISCOVERY:-}"
    local -a extra=()
    if [[ -n "${PDSERVE_EXTRA_ARGS:-}" ]]; then
        read -r -a extra <<<"$PDSERVE_EXTRA_ARGS"
    fi
    while [[ $# -gt 0 ]]; do
        case "$1" in
            -h|--help) role_usage "$role" "$x" "$def_port" "$def_kv_port"; exit 0 ;;
            --model) need_value "$1" $#; model="$2"; shift 2 ;;
            --host) need_value "$1" $#; host="$2"; shift 2 ;;
            --bind) need_value "$1" $#; bind="$2"; shift 2 ;;
            --port) need_value "$1" $#; port="$2"; shift 2 ;;
            --kv-port) need_value "$1" $#; kv_port="$2"; shift 2 ;;
            --engine-id) need_value "$1" $#; engine_id="$2"; shift 2 ;;
            --connector) need_value "$1" $#; connector="$2"; shift 2 ;;
            --served-model-name) need_value "$1" $#; served="$2"; shift 2 ;;
            --discovery) need_value "$1" $#; discovery="$2"; shift 2 ;;
            --tp) need_value "$1" $#; tp="$2"; shift 2 ;;
            --ucx-tls) need_value "$1" $#; export UCX_TLS="$2"; shift 2 ;;
            --ucx-net-devices) need_value "$1" $#; export UCX_NET_DEVICES="$2"; shift 2 ;;
            --dry-run) dry_run=1; shift ;;
            --) shift; extra+=("$@"); break ;;
            -*) die "unknown option '$1' (pdserve flags go after '--')" ;;
            *) [[ -z "$model" || "$model" == "${MODEL:-}" ]] || die "two model directories given"
               model="$1"; shift ;;
        esac
    done
    [[ -n "$model" ]] || die "no model directory: pass --model DIR or set MODEL"
    [[ -n "$host" ]] || die "no address for this host: pass --host ADDR or set ${host_var}" \
        "(the address the other host reaches, e.g. the RDMA NIC's IP)"
    case "$host" in
        0.0.0.0|::|"[::]") die "--host must be a concrete address: it is advertised to the" \
            "peer engine (use --bind 0.0.0.0 to listen everywhere)" ;;
    esac
    case "$connector" in
        NixlPushConnector|NixlConnector) ;;
        *) die "--connector must be NixlPushConnector or NixlConnector, got '$connector'" ;;
    esac
    check_port "--port" "$port"
    check_port "--kv-port" "$kv_port"
    [[ "$tp" =~ ^[1-9][0-9]*$ ]] || die "--tp must be a positive integer, got '$tp'"
    if (( tp > 1 )) && [[ "$connector" == NixlConnector ]]; then
        die "--tp $tp: pull mode (NixlConnector) with tensor parallelism is not supported yet;" \
            "use --connector NixlPushConnector"
    fi
    check_discovery "$discovery"
    [[ "$port" != "$kv_port" ]] || die "--port and --kv-port must differ (both $port)"
    (( kv_port + tp - 1 <= 65535 )) || die "--kv-port $kv_port + --tp $tp runs past port 65535"
    (( port < kv_port || port >= kv_port + tp )) || \
        die "--port $port collides with the side-channel ports $kv_port..$((kv_port + tp - 1))"
    local -a cmd=("$(find_pdserve)" "$role" "$model" --host "${bind:-$host}" --port "$port"
                  --kv-host "$host" --kv-port "$kv_port" --kv-connector "$connector")
    [[ -z "$engine_id" ]] || cmd+=(--engine-id "$engine_id")
    (( tp == 1 )) || cmd+=(--tensor-parallel-size "$tp")
    [[ -z "$served" ]] || cmd+=(--served-model-name "$served")
    [[ -z "$discovery" ]] || cmd+=(--discovery "$discovery" --advertise-host "$host")
    report_ucx_env
    print_and_exec "$dry_run" "${cmd[@]}" "${extra[@]}"
}
