#!/bin/sh
# customize.sh <root>: mmdebstrap customize hook for make-rootfs.sh.
# Adds users (SP_USERS), hostname, the agent (SP_AGENT), the code daemon
# (SP_CODE), the build host's CAs, the spec's files (SP_FILES) and the mount
# points the guest init moves /dev /proc /sys onto.
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
# The build host's own trust roots (/usr/local/share/ca-certificates: an operator's CA, a
# TLS-intercepting proxy's), as the image takes the host's apt sources: what the host was told
# to trust, the sandboxes trust (curl, pip, Node.js, apt over https).
if [ -x "$r/usr/sbin/update-ca-certificates" ] && [ -d /usr/local/share/ca-certificates ]; then
    find /usr/local/share/ca-certificates -name '*.crt' -type f | while read -r c; do
        mkdir -p "$r/usr/local/share/ca-certificates/host"
        cp "$c" "$r/usr/local/share/ca-certificates/host/$(basename "$c")"
    done
    chroot "$r" update-ca-certificates >/dev/null
fi
if [ -n "${SP_FILES:-}" ]; then
    # The spec's files (SP_FILES/list: "<index> <octal mode> <path>" a line), written from
    # inside the image's root, so that its own symlinks resolve there and never on the host.
    while IFS= read -r line; do
        i=${line%% *} rest=${line#* }
        mode=${rest%% *} path=${rest#* } # the rest of the line, as it is
        chroot "$r" /bin/sh -c 'mkdir -p "$(dirname "$1")" && cat >"$1" && chmod "$2" "$1"' \
            sh "$path" "$mode" <"$SP_FILES/$i"
    done <"$SP_FILES/list"
fi
# Each sandbox gets its identity after boot or restore, not from the image.
: >"$r/etc/machine-id"
