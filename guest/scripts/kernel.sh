#!/bin/sh
# kernel.sh - the guest kernel, taken from Debian's linux-image-amd64.
#
#   kernel.sh resolve              prints "<kver>" for the kernel the host's apt
#                                  would install now (ABI name + "_" + version)
#   kernel.sh fetch <dir> <kver>   fills <dir> (must not exist; made atomically):
#       vmlinux        ELF with its PVH note, extracted from the bzImage
#       modules/*.ko   uncompressed modules the initramfs loads
#       modules.load   their load order, one file name a line
#       release        the kernel release (uname -r)
# Exit status 3: the package could not be downloaded (no network?).
#
# The package is unpacked with apt-get download + dpkg-deb -x into a temp dir,
# never installed on the host, and uses the host's own apt configuration.
# Env: SP_GUEST_MODULES overrides the module list (space-separated names).
set -eu
export PATH="$PATH:/usr/sbin:/sbin"

MODULES_DEFAULT="virtio_ring virtio virtio_mmio virtio_console virtio_blk crc16 mbcache jbd2 crc32c_generic ext4"

die() { echo "kernel.sh: $*" >&2; exit 1; }

resolve() {
    # One apt-cache call (each parses the package lists: ~0.5 s without a
    # pkgcache): the metapackage pins the ABI package at its own version.
    dep=$(apt-cache show --no-all-versions linux-image-amd64 2>/dev/null |
          sed -n 's/^Depends:.*\(linux-image-[0-9][^ ,]*-amd64\) (= \([^)]*\)).*$/\1 \2/p' |
          head -n1)
    [ -n "$dep" ] || die "apt cannot resolve linux-image-amd64 (apt-get update?)"
    pkg=${dep% *} ver=${dep#* }
    echo "${pkg#linux-image-}_$ver"
}

# extract_vmlinux <bzImage> <out>: the compressed payload sits at
# payload_offset (setup header 0x248) from the start of the protected-mode
# code ((setup_sects + 1) * 512), payload_length bytes long (0x24c).
u8()  { od -An -tu1 -j "$2" -N1 "$1" | tr -d ' '; }
u32() { od -An -tu4 -j "$2" -N4 "$1" | tr -d ' '; }
extract_vmlinux() {
    setup_sects=$(u8 "$1" $((0x1f1)))
    [ "$setup_sects" -eq 0 ] && setup_sects=4
    off=$(u32 "$1" $((0x248)))
    len=$(u32 "$1" $((0x24c)))
    start=$(( (setup_sects + 1) * 512 + off ))
    magic=$(od -An -tx1 -j "$start" -N6 "$1" | tr -d ' ')
    payload() { tail -c +$((start + 1)) "$1" | head -c "$len"; }
    case "$magic" in
        fd377a585a00*) payload "$1" | xz -dc --single-stream >"$2" ;;
        1f8b*)         payload "$1" | gzip -dc >"$2" 2>/dev/null || [ -s "$2" ] ;;
        28b52ffd*)     payload "$1" | zstd -dcq >"$2" ;;
        5d0000*)       payload "$1" | xz -dc --format=lzma >"$2" 2>/dev/null || [ -s "$2" ] ;;
        *) die "unknown kernel payload compression (magic $magic)" ;;
    esac
    [ "$(od -An -c -N4 "$2" | tr -d ' ')" = "177ELF" ] || die "extracted payload is not an ELF"
}

# modinfo_depends <file.ko>: the "depends=" field of .modinfo (NUL-separated).
modinfo_depends() {
    tr '\0' '\n' <"$1" | sed -n 's/^depends=//p' | head -n1 | tr ',' ' '
}

fetch() {
    out=$1 kver=$2
    for t in apt-get dpkg-deb xz od; do
        command -v "$t" >/dev/null || die "$t is not installed"
    done
    [ -e "$out" ] && die "$out exists"
    pkg="linux-image-${kver%%_*}"
    ver="${kver#*_}"
    tmp=$(mktemp -d "${out}.tmp.XXXXXX")
    chmod 755 "$tmp" # apt-get download drops to _apt and must reach it
    trap 'rm -rf --one-file-system "$tmp"' EXIT
trap 'exit 1' INT TERM
    (cd "$tmp" && apt-get download -q -o APT::Sandbox::User=root "$pkg=$ver" >/dev/null) ||
        { echo "kernel.sh: apt-get download $pkg=$ver failed (network or apt sources?)" >&2; exit 3; }
    dpkg-deb -x "$tmp"/*.deb "$tmp/pkg"
    rm -f "$tmp"/*.deb
    mdir=$(ls -d "$tmp"/pkg/lib/modules/* | head -n1)
    release=$(basename "$mdir")
    mkdir -p "$tmp/out/modules"
    extract_vmlinux "$tmp/pkg/boot/vmlinuz-$release" "$tmp/out/vmlinux"
    echo "$release" >"$tmp/out/release"

    find "$mdir/kernel" -name '*.ko*' >"$tmp/all"
    : >"$tmp/out/modules.load"
    # add <name>: dependencies first, each once; built-ins are skipped.
    add() {
        local n f ko d
        n=$(echo "$1" | tr '-' '_')
        grep -qx "$n.ko" "$tmp/out/modules.load" && return 0
        f=$(grep -E "/$n\.ko(\.xz|\.zst|\.gz)?\$" "$tmp/all" ||
            grep -E "/$(echo "$n" | tr '_' '-')\.ko(\.xz|\.zst|\.gz)?\$" "$tmp/all" || true)
        f=$(echo "$f" | head -n1)
        if [ -z "$f" ]; then
            grep -qE "/($n|$(echo "$n" | tr '_' '-'))\.ko\$" "$mdir/modules.builtin" 2>/dev/null &&
                return 0
            die "module $n is neither a module nor built in for $release"
        fi
        ko="$tmp/out/modules/$n.ko"
        case "$f" in
            *.ko.xz)  xz -dc "$f" >"$ko" ;;
            *.ko.zst) zstd -dcq "$f" >"$ko" ;;
            *.ko.gz)  gzip -dc "$f" >"$ko" ;;
            *)        cp "$f" "$ko" ;;
        esac
        for d in $(modinfo_depends "$ko"); do add "$d"; done
        echo "$n.ko" >>"$tmp/out/modules.load"
    }
    for m in ${SP_GUEST_MODULES:-$MODULES_DEFAULT}; do add "$m"; done
    mv "$tmp/out" "$out"
}

case "${1:-}" in
    resolve) resolve ;;
    fetch) [ $# -eq 3 ] || die "usage: kernel.sh fetch <dir> <kver>"; fetch "$2" "$3" ;;
    *) die "usage: kernel.sh resolve | fetch <dir> <kver>" ;;
esac
