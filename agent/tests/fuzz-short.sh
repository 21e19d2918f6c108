#!/bin/sh
# fuzz-short.sh [WORKDIR] - builds the agentproto fuzzer with clang and runs it ~30 s.
# Exits 77 (skip) when clang or libFuzzer is not available.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
work=${1:-${TMPDIR:-/tmp}/sp-fuzz-agentproto}
secs=${SP_FUZZ_SECONDS:-30}
mkdir -p "$work/corpus"
command -v clang >/dev/null 2>&1 || { echo "skip: no clang"; exit 77; }
if ! clang -std=gnu11 -D_GNU_SOURCE -g -O1 -fsanitize=fuzzer,address,undefined \
    -fno-sanitize-recover=all -I"$root" \
    "$here/fuzz_agentproto.c" "$root/base/agentproto.c" "$root/base/err.c" \
    -o "$work/fuzz_agentproto" 2>"$work/build.log"; then
    if grep -q "libclang_rt.fuzzer\|fuzzer.*not found\|cannot find" "$work/build.log"; then
        echo "skip: clang has no libFuzzer runtime"; exit 77
    fi
    cat "$work/build.log"; exit 1
fi
exec "$work/fuzz_agentproto" -max_total_time="$secs" -max_len=8192 -rss_limit_mb=1024 \
    -print_final_stats=1 "$work/corpus"
