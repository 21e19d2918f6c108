#!/bin/sh
# make-initramfs.sh <kernel-dir> <out.img>
#
# Builds the guest initramfs (an uncompressed newc cpio: under TCG copying a
# few MB is cheaper than decompressing them) from busybox-static, the /init
# beside this script and the modules kernel.sh put in <kernel-dir>. Mtimes
# are pinned (newc still records inode numbers, so the builder names the
# image by its inputs, not its bytes). <out.img> appears atomically.
# Busybox: the host's /bin/busybox when package busybox-static is installed,
# else busybox-static fetched with apt-get download (host apt configuration).
set -eu
export PATH="$PATH:/usr/sbin:/sbin"
die() { echo "make-initramfs.sh: $*" >&2; exit 1; }
[ $# -eq 2 ] || die "usage: make-initramfs.sh <kernel-dir> <out.img>"
kdir=$1 out=$2
here=$(cd "$(dirname "$0")" && pwd)
[ -f "$kdir/modules.load" ] || die "$kdir has no modules.load"

tmp=$(mktemp -d "${out}.tmp.XXXXXX")
trap 'rm -rf --one-file-system "$tmp"' EXIT
trap 'exit 1' INT TERM
st=$tmp/root
mkdir -p "$st/bin" "$st/dev" "$st/proc" "$st/sys" "$st/newroot" "$st/lib/modules"

if dpkg-query -W -f '${Status}' busybox-static 2>/dev/null | grep -q 'ok installed' &&
   [ -x /bin/busybox ]; then
    cp /bin/busybox "$st/bin/busybox"
else
    chmod 755 "$tmp"
    (cd "$tmp" && apt-get download -q -o APT::Sandbox::User=root busybox-static >/dev/null) ||
        die "cannot get busybox-static (install it or check apt)"
    dpkg-deb -x "$tmp"/busybox-static_*.deb "$tmp/bb"
    cp "$tmp/bb/bin/busybox" "$st/bin/busybox"
fi
for a in $("$st/bin/busybox" --list); do
    [ "$a" = busybox ] || ln -s busybox "$st/bin/$a"
done
cp "$here/init" "$st/init"
chmod 755 "$st/init" "$st/bin/busybox"
cp "$kdir/modules.load" "$st/lib/modules/"
while read -r m; do cp "$kdir/modules/$m" "$st/lib/modules/"; done <"$kdir/modules.load"
# The kernel opens /dev/console for init before devtmpfs exists.
mknod -m 600 "$st/dev/console" c 5 1 2>/dev/null || true
find "$st" -exec touch -h -d @0 {} +
(cd "$st" && find . | LC_ALL=C sort | "$st/bin/busybox" cpio -o -H newc -R 0:0) >"$tmp/img" 2>/dev/null
[ -s "$tmp/img" ] || die "cpio failed"
mv "$tmp/img" "$out"
