#!/usr/bin/env bash
# Installs the pinned E2B CLI (and the pinned JS SDK it is checked with) exactly as locked
# (npm ci) and drives the CLI against the server named by the environment:
#   E2B_API_URL, E2B_API_KEY, and E2B_SANDBOX_URL (one plain-HTTP address)
#   or E2B_DOMAIN (+ NODE_EXTRA_CA_CERTS) for host routing;
#   E2B_ACCESS_TOKEN (default: the API key, which space accepts as the access token).
# Arguments are scenario filters ("template/", "sandbox/connect"). Exit 77: cannot run here
# (no node/npm, or the pinned packages cannot be installed); every other failure is 1 or 2.
set -euo pipefail
cd "$(dirname "$0")"

if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "conformance.cli: SKIP: node and npm are not installed (scripts/lib.sh installs them)" >&2
  exit 77
fi
# The CLI declares engines.node >=20; the SDK it is checked with, 20.18.1.
if ! node -e 'const [a,b,c]=process.versions.node.split(".").map(Number);
  process.exit(a>20||(a===20&&(b>18||(b===18&&c>=1)))?0:1)'; then
  echo "conformance.cli: SKIP: node $(node --version) is too old," \
    "the pinned packages need 20.18.1 or later" >&2
  exit 77
fi
if ! command -v tmux >/dev/null; then
  # Not a skip: scripts/lib.sh installs it with the test packages.
  echo "conformance.cli: tmux is not installed (sandbox connect is driven in a tmux pane)" >&2
  exit 1
fi

# The lockfile pins every package by version and integrity hash; npm ci installs exactly
# that (from the local cache when it can) or fails.
if [ "${CONFORMANCE_SKIP_INSTALL:-0}" != 1 ]; then
  log=$(mktemp)
  if ! npm ci --prefer-offline --no-audit --no-fund --loglevel=error >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "conformance.cli: SKIP: npm ci could not install the pinned CLI" \
      "(no registry and no cache?)" >&2
    exit 77
  fi
  rm -f "$log"
fi
for pkg in @e2b/cli e2b; do
  installed=$(node -p "require('./node_modules/$pkg/package.json').version")
  pinned=$(node -p "require('./package.json').dependencies['$pkg']")
  if [ "$installed" != "$pinned" ]; then
    echo "conformance.cli: node_modules has $pkg $installed, package.json pins $pinned" >&2
    exit 1
  fi
done

exec node run.mjs "$@"
