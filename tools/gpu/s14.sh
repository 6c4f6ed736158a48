#!/usr/bin/env bash
# The fourteenth session's GPU work (docs/GPU.md), calls back to back on one warm machine.
# Here, first: tools/gpu/stage.sh && strip .gpu/quiver .gpu/test-*. Carry .gpu/quiver,
# .gpu/test-gpu_ops, .gpu/test-gpu, .gpu/test-archs.
#   s14.sh i   imv against the dp4a kernels and qmm at 2-16 sequences (8B Q4_0, Q8_0, Q4_K_M)
#   s14.sh t   imv's 16 / 32-token forms: the op tests, then 8-32 sequences against qmm
#   s14.sh n   the next session's first call: products by row kind checked and timed
#   s14.sh p   Nsight Compute: imm against qmm at 64 tokens (8B Q4_K_M, Q4_0)
# Every call writes its log under $OUT too.
. "$(dirname "$0")/common.sh"
case $1 in
i)
  (for ty in Q4_K_M Q4_0 Q8_0; do synth llama3-8b $ty $(f8 $ty); done) &
  for round in 1 2; do
    for ty in Q4_K_M Q4_0 Q8_0; do
      wait_for $(f8 $ty)
      for e in QUIVER_CUDA_IMV=0 QUIVER_CUDA_IMV=2-16; do
        el "8B $ty $e"
        env $e $B/quiver bench -m $(f8 $ty) --device cuda -p 512 -n 128 --parallel 2,3,4,6,8,12,16 2>/dev/null | grep "^| " | tail -7
      done
    done
  done
  el done
  ;;
t)
  # The exact-sum op tests (imv's 16 and 32-token forms, imm's 8-warp form), the serving
  # invariance tests (the default path with int8_mma: decode rows of mixed steps on kvd), then
  # 8 to 32 sequences on imv (QUIVER_CUDA_IMV=3-32) against the default (qmm from 9), and imm
  # against qmm at 64 and 128.
  (for ty in Q4_K_M Q4_0; do synth llama3-8b $ty $(f8 $ty); done) &
  el "op test int8_mma"
  timeout 200 $B/test-gpu_ops --include-ignored --test-threads=1 --nocapture int8_mma 2>&1 |
    grep -E "^test |panicked|differ|result" | head -30
  el "serving invariance"
  timeout 200 $B/test-gpu --include-ignored --test-threads=1 serving 2>&1 | grep -E "^test |panicked|left|right|result" | head -20
  for ty in Q4_K_M Q4_0; do
    wait_for $(f8 $ty)
    for e in X=1 QUIVER_CUDA_IMV=3-32; do
      el "8B $ty $e"
      env $e $B/quiver bench -m $(f8 $ty) --device cuda -p 512 -n 128 --parallel 8,12,16,24,32 2>/dev/null | grep "^| " | tail -5
    done
  done
  for ty in Q4_K_M Q4_0; do
    for e in X=1 QUIVER_CUDA_INT8_MMA=1; do
      el "8B $ty $e"
      env $e $B/quiver bench -m $(f8 $ty) --device cuda -p 512 -n 128 --parallel 64,128 2>/dev/null | grep "^| " | tail -2
    done
  done
  el done
  ;;
n)
  # The next session's first call (written after this session's GPU time): products by row
  # kind with QUIVER_CUDA_INT8_MMA=1 (prompt rows on qmm unsplit, decode rows on the exact
  # kernels), a known prompt row never decode-shaped. The op tests, every serving test, the
  # architectures' parity, then the cost against the default: pp512 and S_TG at 1, 8, 64, 128
  # (8B Q4_K_M, Q4_0), alternated twice.
  (for ty in Q4_K_M Q4_0; do synth llama3-8b $ty $(f8 $ty); done) &
  for f in matmul int8_mma; do
    el "op test $f"
    timeout 300 $B/test-gpu_ops --include-ignored --test-threads=1 --nocapture $f 2>&1 |
      grep -E "^test |products|panicked|differ|result" | head -30
  done
  el "engine GPU tests"
  timeout 300 $B/test-gpu --include-ignored --test-threads=1 2>&1 | grep -E "^test |panicked|left|right|result" | head -30
  el "architectures"
  timeout 200 $B/test-archs --include-ignored gpu_matches 2>&1 | grep -E "panicked|result"
  for round in 1 2; do
    for ty in Q4_K_M Q4_0; do
      wait_for $(f8 $ty)
      for e in X=1 QUIVER_CUDA_INT8_MMA=1; do
        el "8B $ty $e"
        env $e $B/quiver bench -m $(f8 $ty) --device cuda -p 512 -n 128 --parallel 1,8,64,128 2>/dev/null | grep "^| " | tail -4
      done
    done
  done
  el done
  ;;
p)
  for ty in Q4_K_M Q4_0; do synth llama3-8b $ty $(f8 $ty); done
  k=q4_k
  for ty in Q4_K_M Q4_0; do
    [ $ty = Q4_0 ] && k=q4_0
    for e in X=1 QUIVER_CUDA_INT8_MMA=1; do
      el "ncu 8B $ty $e, 64 tokens"
      env $e QUIVER_CUDA_GRAPHS=0 timeout 150 ncu --clock-control none -k "regex:^(imm|qmm)_$k\$" --launch-skip 600 --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        $B/quiver bench -m $(f8 $ty) --device cuda -p 16 -n 32 --parallel 64 >/tmp/ncu.txt 2>&1
      cp /tmp/ncu.txt $OUT/ncu-$ty-${e%%=*}.txt
      grep -E "^  [a-z]+_|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Compute \(SM\) Throughput|Memory Throughput|L1/TEX Cache Throughput|DRAM Throughput|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|Grid Size|Dynamic Shared|Stall|Shared Memory Configuration Size" /tmp/ncu.txt | head -60
    done
  done
  el done
  ;;
esac
