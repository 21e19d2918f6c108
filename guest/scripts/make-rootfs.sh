#!/bin/sh
# make-rootfs.sh <out-dir>
#
# Builds a template's root filesystem tree with mmdebstrap into <out-dir>
# (must not exist; it appears only when complete). Packages come from the
# host's own apt sources, fed to mmdebstrap on stdin: nothing here names a
# mirror. The spec reaches this script through the environment (the C
# builder sets it from template.json):
#   SP_SUITE      Debian suite, e.g. bookworm                    (required)
#   SP_VARIANT    mmdebstrap variant                        (default minbase)
#   SP_PACKAGES   comma-separated extra packages
#   SP_USERS      lines "name:uid:home:shell:sudo" (sudo 1 = passwordless)
#   SP_HOSTNAME   /etc/hostname                               (default space)
#   SP_AGENT      the guest agent binary, installed as /usr/local/bin/space-agent
#   SP_CODE       a directory with the code daemon: space-code, installed as
#                 /usr/local/bin/space-code, and its modules, in /usr/local/lib/space-code
#                 (optional)
#   SP_APT_SOURCES  sources file to use instead of the host's (optional)
set -eu
export PATH="$PATH:/usr/sbin:/sbin"
die() { echo "make-rootfs.sh: $*" >&2; exit 1; }
[ $# -eq 1 ] || die "usage: make-rootfs.sh <out-dir>"
out=$1
here=$(cd "$(dirname "$0")" && pwd)
: "${SP_SUITE:?SP_SUITE is required}"
[ -e "$out" ] && die "$out exists"
command -v mmdebstrap >/dev/null || die "mmdebstrap is not installed"
[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap --mode=root keeps file ownership right)"
if [ -n "${SP_AGENT:-}" ]; then
    [ -f "$SP_AGENT" ] || die "agent binary $SP_AGENT not found"
fi
if [ -n "${SP_CODE:-}" ]; then
    [ -f "$SP_CODE/space-code" ] || die "code daemon $SP_CODE/space-code not found"
fi

# The host's apt sources, in one format: deb822 files if there are any,
# else the one-line ones (mmdebstrap takes either on stdin, not a mix).
sources=$(mktemp)
tmp=
mpid=
# --one-file-system: never descend into a mount mmdebstrap may still hold.
cleanup() { rm -f "$sources"; [ -z "$tmp" ] || rm -rf --one-file-system "$tmp"; }
# On INT/TERM stop mmdebstrap first and let it unmount, then clean up.
stop() { [ -z "$mpid" ] || { kill -TERM "$mpid" 2>/dev/null; wait "$mpid"; }; cleanup; exit 1; }
trap cleanup EXIT
trap stop INT TERM
if [ -n "${SP_APT_SOURCES:-}" ]; then
    cat "$SP_APT_SOURCES" >"$sources"
else
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] && { cat "$f"; echo; }
    done >"$sources"
    if ! grep -q '^URIs:' "$sources"; then
        for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
            [ -f "$f" ] && grep -E '^[[:space:]]*deb[[:space:]]' "$f"
        done >"$sources" || true
    fi
fi
[ -s "$sources" ] || die "no apt sources found on the host"

tmp=$(mktemp -d "${out}.tmp.XXXXXX")
export SP_HOSTNAME="${SP_HOSTNAME:-space}" SP_USERS="${SP_USERS:-}" SP_AGENT="${SP_AGENT:-}" \
    SP_CODE="${SP_CODE:-}"
# Docs, man pages and translations are dropped: they cost image space and
# every sandbox's page cache, and nobody reads them in a sandbox.
mmdebstrap --mode=root --variant="${SP_VARIANT:-minbase}" \
    ${SP_PACKAGES:+--include="$SP_PACKAGES"} \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook="$here/customize.sh" \
    "$SP_SUITE" "$tmp/root" - <"$sources" &
mpid=$!
wait "$mpid" || die "mmdebstrap failed (network, apt sources or package names?)"
mpid=
mv "$tmp/root" "$out"
