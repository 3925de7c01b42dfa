#!/usr/bin/env bash
# bash benchmarks/snapshot.sh COMMIT DIR: an importable copy of draftsmith as it was at COMMIT, in DIR/draftsmith
# (the top-level folders laid out under one package, as the install maps them), for side-by-side benchmarks
# (benchmarks/decode_ab.py --old DIR).
set -euo pipefail
commit=$1
dir=$2
root=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$dir"
mkdir -p "$dir/src" "$dir/draftsmith"
git -C "$root" archive "$commit" | tar -x -C "$dir/src"
cp -r "$dir/src/draftsmith/." "$dir/draftsmith/"
for p in models data train eval kernels recipes; do cp -r "$dir/src/$p" "$dir/draftsmith/$p"; done
