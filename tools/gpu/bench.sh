#!/usr/bin/env bash
# The GPU machine's one script (tools/gpu/README.md), run from a call with the binaries of
# tools/gpu/stage.sh carried in .gpu/:
#   tools/gpu/bench.sh MATRIX            make the matrix's models (quiver synth, once per warm
#                                        machine, in /tmp/quiver-models) and build llama.cpp if the
#                                        matrix has the peer, then bench: every model x test x
#                                        config, rounds alternated; $OUT/results.md, results.jsonl,
#                                        bench.log
#   tools/gpu/bench.sh prepare MATRIX    only the models and llama.cpp's build (side by side)
#   tools/gpu/bench.sh compare MATRIX    quiver compare (GPU against CPU) per model x config
#   tools/gpu/bench.sh tests [SET...]    the GPU tests: compile, ops[:FILTER,...], engine,
#                                        engine-real, archs, llama-archs, spec, eagle3, mtp, tp
#                                        (default: all but engine-real)
#   tools/gpu/bench.sh peer              only llama.cpp's build (tools/gpu/peer.sh build)
# Options (anywhere): -n / --dry-run (print the commands, run none), --only model=NAME |
# config=NAME | test=TEXT (repeatable), --budget S (no command starts after S seconds; default
# 540, inside a call's 600), --rounds N, --reps N.
set -euo pipefail
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1 RUST_BACKTRACE=1
export QUIVER_HOME=${QUIVER_HOME:-/tmp/quiver-home}
# Kernels compiled here by stage.sh --kernels: into the machine's cache, not compiled again.
# Each file goes in under a name of this process's, then is renamed into place: two bench.sh
# started together (a prepare beside the tests) never see each other's half-written files.
if [ -d .gpu/home/kernels ]; then
  mkdir -p "$QUIVER_HOME/kernels"
  for f in .gpu/home/kernels/*; do
    dst=$QUIVER_HOME/kernels/${f##*/}
    [ -e "$dst" ] || { cp "$f" "$dst.$$" && mv -f "$dst.$$" "$dst"; }
  done
fi
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec python3 "$(dirname "$0")/bench.py" "$@"
