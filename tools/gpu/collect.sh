#!/usr/bin/env bash
# The last step of a GPU call: a call brings back at most 8 files, none deeper than
# $OUT/a/b/file (the device README's limits), and a call that runs several steps (tests,
# prepare, two matrices, a profile) writes more. This keeps each step's results.md at the top,
# named after its folder ($OUT/ds/results.md → $OUT/ds-results.md), and puts everything else
# under $OUT into one archive, $OUT/out.tar.xz (`tar xJf` it here).
#   tools/gpu/collect.sh        (reads $OUT)
set -euo pipefail
cd "${OUT:?collect.sh: OUT is not set}"
for f in */results.md; do
  [ -e "$f" ] && cp "$f" "${f%%/*}-results.md"
done
tar cJf /tmp/collect-out.tar.xz --exclude='./*-results.md' .
find . -mindepth 1 -maxdepth 1 ! -name '*-results.md' -exec rm -rf {} +
mv /tmp/collect-out.tar.xz out.tar.xz
ls -la
