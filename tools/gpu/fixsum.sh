#!/usr/bin/env bash
# The exact-sum order of the int8 kernels (twelfth session, compiled with NVRTC only), in one
# call (docs/GPU.md, "The next GPU session"). Here, first: tools/gpu/stage.sh && strip
# .gpu/quiver .gpu/test-*; carry .gpu/quiver and .gpu/test-gpu_ops. It runs:
#  - the product op test (its int8_mma configurations: imm, imv, mmvqc against the reference
#    for every type and 1–150 tokens), then the int8_mma tests: the exact-sum reference's bits
#    (Q4_0, Q8_0) and the same bits across the cut-over (Q4_0, Q8_0, Q4_K);
#  - 8B Q4_0 and Q4_K_M, default against QUIVER_CUDA_INT8_MMA=1 (mmvqc decode, imm / imv),
#    alternated twice: pp512, tg128, S_TG at 8 and 64.
set -uo pipefail
export QUIVER_HOME=${QUIVER_HOME:-/tmp/quiver-home} RUST_BACKTRACE=1
B=.gpu
W=/tmp/peer
mkdir -p "$W"
t0=$(date +%s)
el() { echo "[$(($(date +%s) - t0))s] $*"; }
(for ty in Q4_0 Q4_K_M; do
   f=$W/llama3-8b-$ty.gguf
   [ -s "$f" ] || $B/quiver synth --preset llama3-8b --type $ty -o "$f" >/dev/null 2>&1
   echo ok >"$f.done"
 done) &
el "products op test"
for f in matmul int8_mma; do
  timeout 240 $B/test-gpu_ops --include-ignored --test-threads=1 --nocapture $f 2>&1 |
    grep -E "^test |products|panicked|differ|result" | head -30
done
for ty in Q4_0 Q4_K_M; do
  f=$W/llama3-8b-$ty.gguf
  while [ ! -s "$f.done" ]; do sleep 2; done
  for e in X=1 QUIVER_CUDA_INT8_MMA=1 X=1 QUIVER_CUDA_INT8_MMA=1; do
    el "8B $ty $e"
    env $e $B/quiver bench -m "$f" --device cuda -p 512 -n 128 -r 2 2>/dev/null | grep "^| "
    env $e $B/quiver bench -m "$f" --device cuda -p 512 -n 128 --parallel 8,64 2>/dev/null | grep "^| " | tail -2
  done
done
el done
