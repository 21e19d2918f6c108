#!/bin/sh
# customize.sh <root>: mmdebstrap customize hook for make-rootfs.sh.
# Adds users (SP_USERS), hostname, the agent (SP_AGENT), the code daemon
# (SP_CODE) and the mount points the guest init moves /dev /proc /sys onto.
# Runs on the host as root.
set -eu
export PATH="$PATH:/usr/sbin:/sbin"
r=$1
echo "$SP_HOSTNAME" >"$r/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' \
    "$SP_HOSTNAME" >"$r/etc/hosts"
echo "$SP_USERS" | while IFS=: read -r name uid home shell sudo; do
    [ -n "$name" ] || continue
    chroot "$r" useradd --uid "$uid" --home-dir "$home" --create-home \
        --shell "${shell:-/bin/bash}" --user-group "$name"
    chroot "$r" passwd --quiet --delete "$name" >/dev/null
    if [ "$sudo" = 1 ]; then
        [ -d "$r/etc/sudoers.d" ] || { echo "customize.sh: sudo for $name but no sudo package" >&2; exit 1; }
        # sudo skips files in sudoers.d whose names contain a '.'
        f="$r/etc/sudoers.d/90-space-$(echo "$name" | tr . _)"
        echo "$name ALL=(ALL:ALL) NOPASSWD:ALL" >"$f"
        chmod 440 "$f"
    fi
done
mkdir -p "$r/usr/local/bin" "$r/dev" "$r/proc" "$r/sys" "$r/run" "$r/tmp"
if [ -n "$SP_AGENT" ]; then
    cp "$SP_AGENT" "$r/usr/local/bin/space-agent"
    chmod 755 "$r/usr/local/bin/space-agent"
fi
if [ -n "${SP_CODE:-}" ]; then
    # SP_CODE is a directory: space-code goes on the PATH, the modules it loads beside it
    # in /usr/local/lib/space-code.
    cp "$SP_CODE/space-code" "$r/usr/local/bin/space-code"
    chmod 755 "$r/usr/local/bin/space-code"
    mkdir -p "$r/usr/local/lib/space-code"
    for f in "$SP_CODE"/*; do
        [ "$(basename "$f")" = space-code ] && continue
        cp "$f" "$r/usr/local/lib/space-code/"
        chmod 644 "$r/usr/local/lib/space-code/$(basename "$f")"
    done
fi
# Each sandbox gets its identity after boot or restore, not from the image.
: >"$r/etc/machine-id"
