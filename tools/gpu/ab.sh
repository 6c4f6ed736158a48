#!/usr/bin/env bash
# Old and new binaries alternated on the GPU machine, in one call: `quiver bench` prompt and
# generation speed (pp512/tg128) and llama-batched-bench's measurement (--parallel), on
# `quiver synth` models. The old binary is .gpu/quiver-old (build it from the older commit and
# copy it there), the new .gpu/quiver (tools/gpu/stage.sh). JSON lines go to $OUT/ab.jsonl.
# Usage: tools/gpu/ab.sh ROUNDS PAR SPEC...   with SPEC = arch:preset:type, e.g.
#        tools/gpu/ab.sh 2 1,8,64 llama:llama3-8b:Q4_K_M llama:smollm2-135m:Q4_1
set -uo pipefail
B=.gpu
O=${OUT:-/tmp/out}
M=/tmp/quiver-models
mkdir -p "$M" "$O"
rounds=$1 par=$2
shift 2
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
for spec in "$@"; do
  IFS=: read -r arch preset ty <<<"$spec"
  f="$M/$preset-$ty.gguf"
  [ -s "$f" ] || $B/quiver synth --arch "$arch" --preset "$preset" --type "$ty" -o "$f" >/dev/null
  for r in $(seq "$rounds"); do
    for bin in quiver-old quiver; do
      s=$($B/$bin bench -m "$f" --device cuda -p 512 -n 128 -r 3 --json 2>/dev/null | tr -d '\n')
      echo "{\"round\": $r, \"bin\": \"$bin\", \"model\": \"$preset-$ty\", \"single\": ${s:-null}}" | tee -a "$O/ab.jsonl"
      p=$($B/$bin bench -m "$f" --device cuda -p 512 -n 128 --parallel "$par" --json 2>/dev/null | tr -d '\n')
      echo "{\"round\": $r, \"bin\": \"$bin\", \"model\": \"$preset-$ty\", \"parallel\": ${p:-null}}" | tee -a "$O/ab.jsonl"
    done
  done
done
