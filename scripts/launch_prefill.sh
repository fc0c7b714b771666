#!/usr/bin/env bash
# Start the prefill (P) engine of a two-host P/D deployment on this host.
# `scripts/launch_prefill.sh --help` for flags and environment variables; docs/two-node.md.
set -euo pipefail
LAUNCH_NAME="$(basename "$0")"
# shellcheck source=launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
launch_role prefill P 8100 5600 "$@"
