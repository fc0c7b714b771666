#!/usr/bin/env bash
# Start the P/D proxy of a two-host deployment (on either host, or a third one).
# `scripts/launch_proxy.sh --help` for flags and environment variables; docs/two-node.md.
set -euo pipefail
LAUNCH_NAME="$(basename "$0")"
# shellcheck source=launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"

usage() {
    cat <<USAGE
Usage: ${LAUNCH_NAME} [options] [-- extra 'pdserve proxy' flags]

Start the proxy in front of a prefill (P) and a decode (D) engine:
  pdserve proxy --prefill http://P_HOST:P_PORT --decode http://D_HOST:D_PORT --mode push ...
or in front of every engine registered in etcd (launch_{prefill,decode}.sh --discovery):
  pdserve proxy --discovery etcd://HOST:PORT --mode push ...

Options (environment variable in brackets; a flag wins):
  --prefill-host ADDR   P's address [P_HOST]
  --prefill-port N      P's HTTP port; default 8100 [P_PORT]
  --decode-host ADDR    D's address [D_HOST]
  --decode-port N       D's HTTP port; default 8200 [D_PORT]
  --prefill-url URLS    comma-separated P URLs, instead of host/port (several P) [P_URLS]
  --decode-url URLS     comma-separated D URLs, instead of host/port (several D) [D_URLS]
  --discovery URL       find P and D in etcd (etcd://HOST:PORT or etcds://), instead of
                        the hosts and URLs above; with PDSERVE_KV_SECRET set, only
                        registrations signed with it are routed to [DISCOVERY]
  --mode MODE           push (P writes KV into D, default) or pull [PROXY_MODE]
  --host ADDR           address the proxy binds; default 127.0.0.1, 0.0.0.0 to serve
                        other hosts [PROXY_HOST]
  --port N              proxy port; default 8000 [PROXY_PORT]
  --dry-run             print the pdserve command line and exit
  -h, --help            this help

The engines' roles must match the mode: push needs NixlPushConnector on both, pull
NixlConnector. PDSERVE_API_KEY, if set, is required from clients and sent to the engines.
Extra pdserve flags: after '--', or in PDSERVE_EXTRA_ARGS (split on spaces), e.g.
  -- --request-timeout 300 --p-failure-policy fail
The pdserve executable: \$PDSERVE, else the checkout's .venv/bin/pdserve, else PATH.
USAGE
}

# urls LIST — one --prefill/--decode value per comma-separated entry, checked.
split_urls() {
    local flag="$1" list="$2" url
    local -a parts
    IFS=',' read -r -a parts <<<"$list"
    for url in "${parts[@]}"; do
        [[ "$url" =~ ^https?://[^/]+$ ]] || die "bad $flag URL '$url' (want http://HOST:PORT)"
        urls+=("$flag" "$url")
    done
}

p_host="${P_HOST:-}" p_port="${P_PORT:-8100}" d_host="${D_HOST:-}" d_port="${D_PORT:-8200}"
p_urls="${P_URLS:-}" d_urls="${D_URLS:-}" mode="${PROXY_MODE:-push}"
host="${PROXY_HOST:-127.0.0.1}" port="${PROXY_PORT:-8000}" dry_run=0
discovery="${DISCOVERY:-}"
extra=()
if [[ -n "${PDSERVE_EXTRA_ARGS:-}" ]]; then
    read -r -a extra <<<"$PDSERVE_EXTRA_ARGS"
fi
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --prefill-host) need_value "$1" $#; p_host="$2"; shift 2 ;;
        --prefill-port) need_value "$1" $#; p_port="$2"; shift 2 ;;
        --decode-host) need_value "$1" $#; d_host="$2"; shift 2 ;;
        --decode-port) need_value "$1" $#; d_port="$2"; shift 2 ;;
        --prefill-url) need_value "$1" $#; p_urls="$2"; shift 2 ;;
        --decode-url) need_value "$1" $#; d_urls="$2"; shift 2 ;;
        --mode) need_value "$1" $#; mode="$2"; shift 2 ;;
        --discovery) need_value "$1" $#; discovery="$2"; shift 2 ;;
        --host) need_value "$1" $#; host="$2"; shift 2 ;;
        --port) need_value "$1" $#; port="$2"; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        --) shift; extra+=("$@"); break ;;
        *) die "unknown argument '$1' (pdserve flags go after '--')" ;;
    esac
done

case "$mode" in push|pull) ;; *) die "--mode must be push or pull, got '$mode'" ;; esac
check_port "--port" "$port"
check_discovery "$discovery"
urls=()
if [[ -n "$discovery" ]]; then
    [[ -z "$p_host$p_urls$d_host$d_urls" ]] || die "--discovery replaces the prefill and" \
        "decode hosts and URLs (and P_HOST, P_URLS, D_HOST, D_URLS): give one or the other"
    urls=(--discovery "$discovery")
else
    if [[ -z "$p_urls" ]]; then
        [[ -n "$p_host" ]] || die "no prefill engine: pass --prefill-host ADDR or set P_HOST"
        check_port "--prefill-port" "$p_port"
        p_urls="http://${p_host}:${p_port}"
    fi
    if [[ -z "$d_urls" ]]; then
        [[ -n "$d_host" ]] || die "no decode engine: pass --decode-host ADDR or set D_HOST"
        check_port "--decode-port" "$d_port"
        d_urls="http://${d_host}:${d_port}"
    fi
    split_urls --prefill "$p_urls"
    split_urls --decode "$d_urls"
fi
cmd=("$(find_pdserve)" proxy "${urls[@]}" --mode "$mode" --host "$host" --port "$port")
[[ -z "${PDSERVE_API_KEY:-}" ]] || cmd+=(--api-key "$PDSERVE_API_KEY")
print_and_exec "$dry_run" "${cmd[@]}" "${extra[@]}"
