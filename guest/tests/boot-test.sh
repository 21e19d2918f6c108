#!/bin/bash
# boot-test.sh <space-guest> - ctest guest.boot (label e2e).
#
# Builds, or reuses from its cache, the guest kernel, the initramfs and a
# tiny test root (busybox + tests/placeholder-agent as space-agent), boots it
# under qemu-system-x86_64 -M microvm -accel tcg with the QEMU line from
# guest/bootargs.c (via "space-guest qemu-args"), waits for "ready" on the
# agent's virtio-serial unix socket, reports the boot time and kills QEMU.
# Exits 77 (skip) when QEMU or apt's network access is missing.
#
# Env:
#   SP_TEST_CACHE_DIR      cache (default: <build>/test-cache/guest)
#   SP_TEST_TIMEOUT_MULT   stretches the 60 s boot timeout
#   SP_TEST_BOOTS          boots to run, median reported (default 1)
#   SP_TEST_FULL=1         boot the real "base" template instead of the test
#                          root (built with mmdebstrap into the cache; root)
#   SP_TEST_AGENT=<bin>    with SP_TEST_FULL: the agent to put in the image
#                          (default: the placeholder); ready is then a console
#                          line containing "ready" unless it is the placeholder
#   SP_TEST_KEEP=1         keep the run dirs (console logs)
#   SP_TEST_APPEND=<args>  extra kernel command line (experiments)
set -u
tool=${1:?usage: boot-test.sh <space-guest>}
here=$(cd "$(dirname "$0")" && pwd)
scripts=$here/../scripts
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

command -v qemu-system-x86_64 >/dev/null || skip "qemu-system-x86_64 is not installed"
for t in qemu-img apt-get apt-cache dpkg-deb xz; do
    command -v "$t" >/dev/null || skip "$t is not installed"
done
PATH=$PATH:/usr/sbin:/sbin
command -v mkfs.ext4 >/dev/null || skip "mkfs.ext4 is not installed"
[ -x /bin/busybox ] || skip "busybox-static is not installed"
mult=${SP_TEST_TIMEOUT_MULT:-1}
timeout_ms=$(awk -v m="$mult" 'BEGIN { printf "%d", 60000 * m }')
cache=${SP_TEST_CACHE_DIR:-${SP_TEST_DEFAULT_CACHE:-${TMPDIR:-/tmp}/space-guest-test-cache}}
mkdir -p "$cache" || fail "cannot make cache dir $cache"
cache=$(cd "$cache" && pwd)

sha() { cat "$@" | sha256sum | cut -c1-16; }
t_now() { date +%s%N; }
ms_since() { echo $(( ($(t_now) - $1) / 1000000 )); }

if [ "${SP_TEST_FULL:-0}" = 1 ]; then
    [ "$(id -u)" = 0 ] || skip "SP_TEST_FULL needs root (mmdebstrap)"
    agent=${SP_TEST_AGENT:-$here/placeholder-agent}
    t0=$(t_now)
    out=$("$tool" build base --data-dir "$cache/data" --agent "$agent" --quiet 2>"$cache/build.err")
    rc=$?
    if [ $rc -ne 0 ]; then
        cat "$cache/build.err"
        grep -q 'download' "$cache/build.err" && skip "cannot download packages (no network for apt?)"
        fail "template build failed"
    fi
    echo "base template ready in $(ms_since "$t0") ms (cached builds are instant)"
    kernel=$(echo "$out" | sed -n 's/^kernel=//p')
    initrd=$(echo "$out" | sed -n 's/^initramfs=//p')
    base=$(echo "$out" | sed -n 's/^rootfs=//p')
    [ "$agent" = "$here/placeholder-agent" ] && ready=socket || ready=console
else
    # Kernel: what apt would install now, else the newest one cached.
    kver=$(sh "$scripts/kernel.sh" resolve 2>/dev/null) ||
        kver=$(ls "$cache/kernel" 2>/dev/null | sort -V | tail -n1)
    [ -n "$kver" ] || skip "apt cannot resolve linux-image-amd64 and nothing is cached"
    kdir=$cache/kernel/$kver
    if [ ! -f "$kdir/vmlinux" ]; then
        mkdir -p "$cache/kernel"
        t0=$(t_now)
        sh "$scripts/kernel.sh" fetch "$kdir" "$kver"
        rc=$?
        [ $rc -eq 3 ] && skip "cannot download the kernel package (no network for apt?)"
        [ $rc -eq 0 ] || fail "kernel.sh fetch failed ($rc)"
        echo "kernel $kver fetched in $(ms_since "$t0") ms"
    fi
    kernel=$kdir/vmlinux
    key=$(sha "$scripts/init" "$scripts/make-initramfs.sh" /bin/busybox "$kdir/modules.load")
    initrd=$cache/initramfs-$kver-$key.img
    if [ ! -f "$initrd" ]; then
        sh "$scripts/make-initramfs.sh" "$kdir" "$initrd" || fail "make-initramfs.sh failed"
    fi
    key=$(sha "$here/placeholder-agent" "$here/make-testroot.sh" "$scripts/make-image.sh" /bin/busybox)
    base=$cache/testroot-$key.qcow2
    if [ ! -f "$base" ]; then
        sh "$here/make-testroot.sh" "$base" || fail "make-testroot.sh failed"
    fi
    ready=socket
fi

boot() { # boot <n>: one cold boot; prints "<ms>" on success
    local run pid ms rc=1 i
    run=$(mktemp -d "$cache/run.XXXXXX")
    qemu-img create -q -f qcow2 -F qcow2 -b "$base" "$run/disk.qcow2" || return 1
    local args
    mapfile -t args < <("$tool" qemu-args --kernel "$kernel" --initrd "$initrd" \
        --disk "$run/disk.qcow2" --agent-sock "$run/agent.sock" --qmp-sock "$run/qmp.sock" \
        --console "$run/console.log" ${SP_TEST_APPEND:+--append "$SP_TEST_APPEND"})
    [ ${#args[@]} -gt 10 ] || { echo "space-guest qemu-args failed" >&2; return 1; }
    [ "$1" = 1 ] && echo "qemu: ${args[*]}" >&2
    local t0
    t0=$(t_now)
    "${args[@]}" >"$run/qemu.out" 2>&1 &
    pid=$!
    if [ "$ready" = socket ]; then
        if "$tool" wait-ready "$run/agent.sock" "$timeout_ms" >/dev/null; then
            ms=$(ms_since "$t0")
            rc=0
        fi
    else
        for ((i = 0; i < timeout_ms / 50; i++)); do
            if grep -qi 'ready' "$run/console.log" 2>/dev/null; then
                ms=$(ms_since "$t0")
                rc=0
                break
            fi
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.05
        done
    fi
    kill "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    if [ $rc -ne 0 ]; then
        echo "---- console of boot $1:" >&2
        cat "$run/console.log" "$run/qemu.out" >&2 2>/dev/null
    elif [ "$ready" = console ]; then
        echo "---- console of boot $1:" >&2
        cat "$run/console.log" >&2
    fi
    if [ "${SP_TEST_KEEP:-0}" = 1 ]; then
        echo "kept $run" >&2
    else
        rm -rf "$run"
    fi
    [ $rc -eq 0 ] && echo "$ms"
    return $rc
}

n=${SP_TEST_BOOTS:-1}
times=()
for ((b = 1; b <= n; b++)); do
    ms=$(boot "$b") || fail "guest did not report ready within $timeout_ms ms (boot $b)"
    echo "boot $b: ready after $ms ms"
    times+=("$ms")
done
median=$(printf '%s\n' "${times[@]}" | sort -n | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}')
echo "PASS: guest booted to ready under TCG; median ${median} ms over $n boot(s) (QEMU start to ready)"
exit 0
