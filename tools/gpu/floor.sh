#!/usr/bin/env bash
# On the GPU machine: what speculation costs when nothing is accepted (issue 37's floor), on the
# 8B Q4_K_M shape: a random EAGLE-3 head (synth llama3-8b-eagle3), a random draft model of the
# same vocabulary (synth llama3-1b) and prompt lookup; and on Qwen3.5-0.8B's shape with its own
# random multi-token-prediction block (synth qwen3.5-0.8b-mtp: the block and the recurrent
# state's rollback) and prompt lookup; each `quiver bench --spec …` (plain, then with
# speculation, in one run) for every binary given, binaries alternated over two rounds.
#   tools/gpu/floor.sh [BINARY...]   (default .gpu/quiver; e.g. .gpu/quiver-old .gpu/quiver)
# Models in /tmp/quiver-models (made once per warm machine); the rows go to stdout and
# $OUT/floor.txt.
set -euo pipefail
export QUIVER_HOME=${QUIVER_HOME:-/tmp/quiver-home}
if [ -d .gpu/home/kernels ]; then
  mkdir -p "$QUIVER_HOME/kernels"
  cp -n .gpu/home/kernels/* "$QUIVER_HOME/kernels/" 2>/dev/null || true
fi
bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=(.gpu/quiver)
d=/tmp/quiver-models
mkdir -p "$d" "${OUT:-/tmp/out}"
model() { [ -f "$d/$1.gguf" ] || "${bins[0]}" synth --preset "$2" --type Q4_K_M -o "$d/$1.gguf" >/dev/null 2>&1; }
model llama3-8b-Q4_K_M llama3-8b
model llama3-8b-eagle3 llama3-8b-eagle3
model llama3-1b-Q4_K_M llama3-1b
model qwen35-0.8b-mtp-Q4_K_M qwen3.5-0.8b-mtp
m=$d/llama3-8b-Q4_K_M.gguf q=$d/qwen35-0.8b-mtp-Q4_K_M.gguf
for round in 1 2; do
  for run in "$m eagle3 -md $d/llama3-8b-eagle3.gguf" "$m draft -md $d/llama3-1b-Q4_K_M.gguf" "$m ngram" \
    "$q mtp" "$q ngram"; do
    set -- $run
    file=$1
    shift
    for b in "${bins[@]}"; do
      # shellcheck disable=SC2086,SC2048 # the spec's words
      echo "r$round $b $(basename "$file") --spec $*: $(timeout 150 "$b" bench -m "$file" --device cuda -p 256 -n 128 -r 2 --spec $* 2>&1 |
        grep -E '^\| (none|eagle3|draft|ngram|mtp) ' | tr '\n' ' ')"
    done
  done
done | tee "${OUT:-/tmp/out}/floor.txt"
