#!/usr/bin/env bash
# Installs the pinned E2B JS SDK exactly as locked (npm ci) and runs the conformance suite
# against the server named by the environment:
#   E2B_API_URL, E2B_API_KEY, and E2B_SANDBOX_URL (one plain-HTTP address)
#   or E2B_DOMAIN (+ NODE_EXTRA_CA_CERTS) for host routing.
# Arguments are scenario filters ("files/", "commands/pty"). Exit 77: cannot run here
# (../node.sh: no node/npm, or the pinned SDK cannot be installed).
set -euo pipefail
cd "$(dirname "$0")"
. ../node.sh

conf_need_node conformance.js "the pinned SDK"
conf_npm_ci conformance.js "the pinned SDK" e2b
# run_local.py installs once before running several clients of this folder at once.
[ "${CONFORMANCE_INSTALL_ONLY:-0}" = 1 ] && exit 0

exec node run.mjs "$@"
