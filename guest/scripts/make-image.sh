#!/bin/sh
# make-image.sh <root-dir> <size-mib> <out.qcow2>
#
# Makes the read-only template base: an ext4 filesystem filled from
# <root-dir> by mkfs.ext4 -d on a sparse raw file of <size-mib> MiB, then
# converted to qcow2 (only allocated clusters are stored). Ownership, modes
# and xattrs come from <root-dir>, so run as root. Inode tables and the
# journal are zeroed here rather than lazily in the guest, where writes cost
# TCG time and land in every sandbox's overlay; qemu-img drops the zeros.
# <out.qcow2> appears atomically.
set -eu
export PATH="$PATH:/usr/sbin:/sbin"
die() { echo "make-image.sh: $*" >&2; exit 1; }
[ $# -eq 3 ] || die "usage: make-image.sh <root-dir> <size-mib> <out.qcow2>"
root=$1 size=$2 out=$3
[ -d "$root" ] || die "$root is not a directory"
for t in mkfs.ext4 qemu-img truncate; do
    command -v "$t" >/dev/null || die "$t is not installed"
done
tmp=$(mktemp -d "${out}.tmp.XXXXXX")
trap 'rm -rf --one-file-system "$tmp"' EXIT
trap 'exit 1' INT TERM
truncate -s "${size}M" "$tmp/raw"
mkfs.ext4 -q -F -L rootfs -m 0 -E lazy_itable_init=0,lazy_journal_init=0 \
    -d "$root" "$tmp/raw" || die "mkfs.ext4 -d failed (image too small?)"
qemu-img convert -q -f raw -O qcow2 "$tmp/raw" "$tmp/img"
mv "$tmp/img" "$out"
