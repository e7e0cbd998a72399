#!/usr/bin/env bash
# Rebuilds the committed XDP object from its source. Needs clang and
# libbpf-dev (apt-get install clang llvm libbpf-dev). Deterministic for a
# given clang: the bpf crate's test compares the committed object with a
# fresh build when the same clang (filter.o.clang) is installed.
set -euo pipefail
cd "$(dirname "$0")"
out=${1:-filter.o}
clang -O2 -g -target bpf -I/usr/include/x86_64-linux-gnu \
  -fdebug-prefix-map="$PWD"=. -c src/filter.c -o "$out"
if [ "$out" = filter.o ]; then
  clang --version | head -1 > filter.o.clang
fi
