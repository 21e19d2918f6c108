#!/usr/bin/env bash
# Installs the pinned E2B JS SDK exactly as locked (npm ci) and runs the conformance suite
# against the server named by the environment:
#   E2B_API_URL, E2B_API_KEY, and E2B_SANDBOX_URL (one plain-HTTP address)
#   or E2B_DOMAIN (+ NODE_EXTRA_CA_CERTS) for host routing.
# Arguments are scenario filters ("files/", "commands/pty"). Exit 77: cannot run here.
set -euo pipefail
cd "$(dirname "$0")"

if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "conformance.js: SKIP: node and npm are not installed (scripts/lib.sh installs them)" >&2
  exit 77
fi
# e2b 2.21.0 declares engines.node >=20.18.1 (its HTTP client needs it).
if ! node -e 'const [a,b,c]=process.versions.node.split(".").map(Number);
  process.exit(a>20||(a===20&&(b>18||(b===18&&c>=1)))?0:1)'; then
  echo "conformance.js: SKIP: node $(node --version) is too old, the pinned SDK needs 20.18.1 or later" >&2
  exit 77
fi

# The lockfile pins every package by version and integrity hash; npm ci installs exactly
# that (from the local cache when it can) or fails.
if [ "${CONFORMANCE_SKIP_INSTALL:-0}" != 1 ]; then
  log=$(mktemp)
  if ! npm ci --prefer-offline --no-audit --no-fund --loglevel=error >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "conformance.js: SKIP: npm ci could not install the pinned SDK (no registry and no cache?)" >&2
    exit 77
  fi
  rm -f "$log"
fi
installed=$(node -p 'require("./node_modules/e2b/package.json").version')
pinned=$(node -p 'require("./package.json").dependencies.e2b')
if [ "$installed" != "$pinned" ]; then
  echo "conformance.js: node_modules has e2b $installed, package.json pins $pinned" >&2
  exit 1
fi

exec node run.mjs "$@"
