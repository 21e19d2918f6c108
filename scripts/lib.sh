# Shared by scripts/up and scripts/test: install what is missing, build.
# Sourced, not run. Uses the machine's own apt configuration.

SPACE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# Packages for building, running and testing space (Debian 12).
SPACE_PKGS=(
  gcc make cmake pkg-config git ca-certificates python3
  libh2o-evloop-dev libwslay-dev libpq-dev libjansson-dev libssl-dev libsodium-dev zlib1g-dev
  postgresql postgresql-contrib
  qemu-system-x86 qemu-utils busybox-static mmdebstrap e2fsprogs xz-utils zstd musl-tools
  libnss-myhostname
  skopeo umoci
)
SPACE_TEST_PKGS=(clang)
# Templates from container images are tested against Debian's registry on loopback, with an
# htpasswd file made by apache2-utils (e2e/test_images.py).
SPACE_TEST_PKGS+=(docker-registry apache2-utils)
# The E2B SDKs run commands and build steps with /bin/bash: the image conformance/run_local.py
# builds for their from_image scenarios has Debian's statically linked bash.
SPACE_TEST_PKGS+=(bash-static)
# promtool checks the /metrics exposition (server/tests/test_metrics.py); Debian ships it in
# the prometheus package.
SPACE_TEST_PKGS+=(prometheus)
# The guest code daemon's test (guest/tests/test_code_daemon.py) runs real IPython kernels.
SPACE_TEST_PKGS+=(python3-ipykernel python3-jupyter-client python3-numpy python3-pandas
  python3-matplotlib python3-matplotlib-inline)
# The pinned E2B Python SDKs (../shared/pysdk beside the project) run on Debian's python3
# with these (conformance/python).
SPACE_TEST_PKGS+=(python3-dateutil python3-wcmatch python3-protobuf python3-h2 python3-attr
  python3-packaging python3-typing-extensions python3-rich python3-anyio python3-sniffio
  python3-h11 python3-certifi python3-idna)
# repo.deploy (tests/test_deploy.py) renders deploy/kubernetes with `kubectl kustomize` and
# parses it with PyYAML. Debian's kubectl only when there is none: another one (a cloud SDK's)
# serves as well.
SPACE_TEST_PKGS+=(python3-yaml)
command -v kubectl >/dev/null 2>&1 || SPACE_TEST_PKGS+=(kubernetes-client)
# bench/api_bench.py drives the API's reads with wrk (pgbench comes with postgresql-contrib).
SPACE_TEST_PKGS+=(wrk)
# spacectl's end-to-end test drives its interactive shell in a tmux pane (cli/tests), and
# conformance/cli drives the E2B CLI's `sandbox connect` in one.
SPACE_TEST_PKGS+=(tmux)
# Node.js and npm run the JS conformance suite (conformance/js). Debian's packages only when
# the commands are missing: a Node installed another way ships its own npm, which Debian's
# npm package conflicts with. (Debian 12's Node is 18; the pinned SDK wants 20.18 or later,
# so there the suite skips, saying so.)
command -v node >/dev/null 2>&1 || SPACE_TEST_PKGS+=(nodejs)
command -v npm >/dev/null 2>&1 || SPACE_TEST_PKGS+=(npm)

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

install_pkgs() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing: ${missing[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
  fi
  case " $* " in *" libnss-myhostname "*) ensure_nss_myhostname ;; esac
}

# The default sandbox domain is space.localhost:<port> (https://<port>-<id>.space.localhost):
# nss-myhostname resolves every name under localhost to loopback, but only when the hosts:
# line of nsswitch.conf lists it. Debian's package adds it on install; a hand-edited file may
# lack it, so add it right after `files` (before dns). Idempotent; edits the file as root only.
ensure_nss_myhostname() {
  local conf=${SPACE_NSSWITCH_CONF:-/etc/nsswitch.conf}
  [ -f "$conf" ] || return 0
  grep -Eq '^hosts:.*[[:space:]]myhostname([[:space:]]|$)' "$conf" && return 0
  log "adding myhostname to the hosts: line of $conf (sandbox names under localhost)"
  if ! grep -q '^hosts:' "$conf"; then
    echo "hosts: files myhostname dns" | as_root tee -a "$conf" >/dev/null
  elif grep -Eq '^hosts:[[:space:]]*files([[:space:]]|$)' "$conf"; then
    as_root sed -i -E 's/^(hosts:[[:space:]]*files)([[:space:]]|$)/\1 myhostname\2/' "$conf"
  else
    as_root sed -i -E 's/^hosts:[[:space:]]*/&myhostname /' "$conf"
  fi
}

# build DIR [cmake args...]: warnings are errors in our own builds (SPACE_WERROR is off by
# default outside a git checkout, for packagers).
build() {
  local dir=$1; shift
  log "building in ${dir#$SPACE_ROOT/}"
  cmake -S "$SPACE_ROOT" -B "$dir" -DSPACE_WERROR=ON "$@" >/dev/null
  cmake --build "$dir" -j"$(nproc)"
}
