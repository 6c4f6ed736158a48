#!/usr/bin/env bash
# The eleventh session's unverified GPU paths, in one call (docs/GPU.md, "The next GPU
# session", item 0). Here, first: tools/gpu/stage.sh && strip .gpu/quiver .gpu/test-*
# Carry .gpu/test-gpu_ops .gpu/test-archs .gpu/quiver, then run tools/gpu/moe.sh. It runs:
#  - the MoE op test (`moe_qmm` and `moe_int8` off, then on);
#  - the MoE architectures' parity with llama.cpp with both switches;
#  - Gemma 4 Q8_0's parity under each path switch (which widens its gap);
#  - Qwen3-30B-A3B Q4_0 (synthesized here, ~60 s) timed with the switches off and on.
set -uo pipefail
export QUIVER_HOME=${QUIVER_HOME:-/tmp/quiver-home} RUST_BACKTRACE=1
B=.gpu
W=/tmp/peer
F=$W/qwen3-30b-a3b-Q4_0.gguf
mkdir -p "$W"
t0=$(date +%s)
el() { echo "[$(($(date +%s) - t0))s] $*"; }
([ -s "$F" ] || $B/quiver synth --preset qwen3-30b-a3b --type Q4_0 -o "$F" >/dev/null 2>&1
 touch "$W/synth.done") &
el "MoE op test"
timeout 300 $B/test-gpu_ops --include-ignored --test-threads=1 --nocapture moe 2>&1 |
  grep -E "^test |moe|panicked|result" | head -20
for e in "X=1" "QUIVER_CUDA_MOE_QMM=1 QUIVER_CUDA_MOE_INT8=1"; do
  el "MoE architectures, $e"
  env $e QUIVER_ARCHS=tiny-qwen3moe-Q8_0,tiny-qwen3moe-F32,tiny-gemma4moe-Q8_0,tiny-gemma4moe-F32 \
    timeout 120 $B/test-archs --include-ignored --nocapture gpu_matches 2>&1 |
    grep -E "max \||panicked|result" | head -10
done
for e in X=1 QUIVER_CUDA_TENSOR_CORES=0 QUIVER_CUDA_INT8=0 QUIVER_CUDA_KVD=0 QUIVER_CUDA_FLASH=0; do
  el "Gemma 4 Q8_0, $e"
  env $e QUIVER_ARCHS=tiny-gemma4-Q8_0,tiny-gemma4moe-Q8_0 timeout 120 \
    $B/test-archs --include-ignored --nocapture gpu_matches 2>&1 | grep -E "max \|" | sed 's/, top-1.*//'
done
while [ ! -f "$W/synth.done" ]; do sleep 2; done
for e in X=1 QUIVER_CUDA_MOE_QMM=1 QUIVER_CUDA_MOE_INT8=1 "QUIVER_CUDA_MOE_QMM=1 QUIVER_CUDA_MOE_INT8=1"; do
  el "Qwen3-30B-A3B Q4_0, $e"
  env $e timeout 120 $B/quiver bench -m "$F" --device cuda -p 512 -n 128 -r 2 2>/dev/null | grep "^| "
  env $e timeout 120 $B/quiver bench -m "$F" --device cuda -p 512 -n 128 --parallel 1,8,64 2>/dev/null |
    grep "^| " | tail -3
done
el done
