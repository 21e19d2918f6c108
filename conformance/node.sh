# node.sh - what the Node conformance suites' run.sh (js/, cli/) share; sourced by them, in
# their folder:
#   conf_need_node SUITE WHAT   exits 77 (a skip, saying why) without node and npm, or with a
#                               node older than 20.18.1 (e2b declares engines.node >=20.18.1:
#                               its HTTP client needs it)
#   conf_npm_ci SUITE WHAT PKG...
#                               installs the pinned packages exactly as package-lock.json locks
#                               them (npm ci, from the local cache when it can; exit 77 when it
#                               cannot: no registry and no cache), unless
#                               CONFORMANCE_SKIP_INSTALL=1; then exits 1 unless each PKG in
#                               node_modules is the version package.json pins
# run.sh exits 0 right after conf_npm_ci when CONFORMANCE_INSTALL_ONLY=1 (run_local.py, before
# it starts several clients of one folder at once: npm ci replaces node_modules).
# SUITE names the test in messages (conformance.js); WHAT, what the pins are ("the pinned SDK").

conf_need_node() {
  local suite=$1 what=$2
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "$suite: SKIP: node and npm are not installed (scripts/lib.sh installs them)" >&2
    exit 77
  fi
  if ! node -e 'const [a,b,c]=process.versions.node.split(".").map(Number);
    process.exit(a>20||(a===20&&(b>18||(b===18&&c>=1)))?0:1)'; then
    echo "$suite: SKIP: node $(node --version) is too old, $what needs 20.18.1 or later" >&2
    exit 77
  fi
}

conf_npm_ci() {
  local suite=$1 what=$2 log pkg installed pinned
  shift 2
  # The lockfile pins every package by version and integrity hash; npm ci installs exactly
  # that or fails.
  if [ "${CONFORMANCE_SKIP_INSTALL:-0}" != 1 ]; then
    log=$(mktemp)
    if ! npm ci --prefer-offline --no-audit --no-fund --loglevel=error >"$log" 2>&1; then
      cat "$log" >&2
      rm -f "$log"
      echo "$suite: SKIP: npm ci could not install $what (no registry and no cache?)" >&2
      exit 77
    fi
    rm -f "$log"
  fi
  for pkg in "$@"; do
    installed=$(node -p "require('./node_modules/$pkg/package.json').version")
    pinned=$(node -p "require('./package.json').dependencies['$pkg']")
    if [ "$installed" != "$pinned" ]; then
      echo "$suite: node_modules has $pkg $installed, package.json pins $pinned" >&2
      exit 1
    fi
  done
}
