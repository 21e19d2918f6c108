# Shared by scripts/up and scripts/test: install what is missing, build.
# Sourced, not run. Uses the machine's own apt configuration.

SPACE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# Packages for building, running and testing space (Debian 12).
SPACE_PKGS=(
  gcc make cmake pkg-config git ca-certificates python3
  libh2o-evloop-dev libwslay-dev libpq-dev libjansson-dev libssl-dev libsodium-dev
  postgresql postgresql-contrib
  qemu-system-x86 qemu-utils busybox-static mmdebstrap e2fsprogs xz-utils zstd musl-tools
  libnss-myhostname
)
SPACE_TEST_PKGS=(clang)

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

install_pkgs() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing: ${missing[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
}

# build DIR [cmake args...]
build() {
  local dir=$1; shift
  log "building in ${dir#$SPACE_ROOT/}"
  cmake -S "$SPACE_ROOT" -B "$dir" "$@" >/dev/null
  cmake --build "$dir" -j"$(nproc)"
}
