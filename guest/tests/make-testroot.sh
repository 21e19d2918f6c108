#!/bin/sh
# make-testroot.sh <out.qcow2>: the smallest root the boot test needs:
# busybox-static plus placeholder-agent as /usr/local/bin/space-agent.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=$1
tmp=$(mktemp -d "${out}.root.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
trap 'exit 1' INT TERM
mkdir -p "$tmp/bin" "$tmp/dev" "$tmp/proc" "$tmp/sys" "$tmp/tmp" "$tmp/usr/local/bin"
cp /bin/busybox "$tmp/bin/busybox"
for a in sh cat echo sleep basename dirname; do ln -s busybox "$tmp/bin/$a"; done
cp "$here/placeholder-agent" "$tmp/usr/local/bin/space-agent"
chmod 755 "$tmp/usr/local/bin/space-agent"
sh "$here/../scripts/make-image.sh" "$tmp" 64 "$out"
