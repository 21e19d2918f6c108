#!/bin/sh
# fuzz-short.sh [WORKDIR] - builds the HTTP/1.1 request framing fuzzer (fuzz_http1.c) with clang
# and runs it ~30 s from the seeds in corpus_http1/. Exits 77 (skip) when clang or libFuzzer is
# not available.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
work=${1:-${TMPDIR:-/tmp}/sp-fuzz-http1}
secs=${SP_FUZZ_SECONDS:-30}
mkdir -p "$work/corpus"
command -v clang >/dev/null 2>&1 || { echo "skip: no clang"; exit 77; }
if ! clang -std=gnu11 -D_GNU_SOURCE -g -O1 -fsanitize=fuzzer,address,undefined \
    -fno-sanitize-recover=all -I"$root" \
    "$here/fuzz_http1.c" "$root/core/egress/http1.c" \
    -o "$work/fuzz_http1" 2>"$work/build.log"; then
    if grep -q "libclang_rt.fuzzer\|fuzzer.*not found\|cannot find" "$work/build.log"; then
        echo "skip: clang has no libFuzzer runtime"; exit 77
    fi
    cat "$work/build.log"; exit 1
fi
# New inputs go to the work corpus; the seeds in the tree are only read.
exec "$work/fuzz_http1" -max_total_time="$secs" -max_len=8192 -rss_limit_mb=1024 \
    -print_final_stats=1 "$work/corpus" "$here/corpus_http1"
