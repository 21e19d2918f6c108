#!/usr/bin/env bash
# Installs the pinned E2B CLI (and the pinned JS SDK it is checked with) exactly as locked
# (npm ci) and drives the CLI against the server named by the environment:
#   E2B_API_URL, E2B_API_KEY, and E2B_SANDBOX_URL (one plain-HTTP address)
#   or E2B_DOMAIN (+ NODE_EXTRA_CA_CERTS) for host routing;
#   E2B_ACCESS_TOKEN (default: the API key, which space accepts as the access token).
# Arguments are scenario filters ("template/", "sandbox/connect"). Exit 77: cannot run here
# (../node.sh: no node/npm, or the pinned packages cannot be installed); every other failure
# is 1 or 2.
set -euo pipefail
cd "$(dirname "$0")"
. ../node.sh

# The CLI declares engines.node >=20; the SDK it is checked with, 20.18.1.
conf_need_node conformance.cli "the pinned packages"
if ! command -v tmux >/dev/null; then
  # Not a skip: scripts/lib.sh installs it with the test packages.
  echo "conformance.cli: tmux is not installed (sandbox connect is driven in a tmux pane)" >&2
  exit 1
fi
conf_npm_ci conformance.cli "the pinned CLI" @e2b/cli e2b
# run_local.py installs once before running several clients of this folder at once.
[ "${CONFORMANCE_INSTALL_ONLY:-0}" = 1 ] && exit 0

exec node run.mjs "$@"
