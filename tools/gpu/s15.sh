#!/usr/bin/env bash
# The fifteenth session's GPU work (docs/GPU.md), calls back to back on one warm machine.
# Here, first: tools/gpu/stage.sh && strip .gpu/quiver .gpu/test-*. Carry .gpu/quiver,
# .gpu/test-gpu_ops, .gpu/test-gpu, .gpu/test-archs.
#   s15.sh k   imm_q4_k with the scales folded into A and the mins by mma: the exact-sum op
#              tests, Nsight Compute against qmm at 64 tokens, then default against
#              QUIVER_CUDA_INT8_MMA=1 (8B Q4_K_M: pp512, S_TG at 1, 8, 64, 128) twice
#              (NCU=0: without Nsight Compute's imm / qmm; the decode step's kernels at 1 token)
#   s15.sh f   the sums as floats without the conversion unit; imm's split floor against ceil
#              (carry .gpu/quiver-floor too)
#   s15.sh c   mmvqc1 Q4_K's four-iteration reduce-scatter: op tests, kernels @1 / @64, bench
#   s15.sh r   per-kernel time of one decode step (Nsight Compute, durations only) at 1, 64 and
#              128 sequences, default against QUIVER_CUDA_INT8_MMA=1 (8B Q4_K_M)
# Every call writes its log under $OUT too.
. "$(dirname "$0")/common.sh"
ncu_imm() { # type kernel-suffix env
  env $3 QUIVER_CUDA_GRAPHS=0 timeout 150 ncu --clock-control none -k "regex:^(imm|qmm)_$2\$" --launch-skip 600 --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
    $B/quiver bench -m $(f8 $1) --device cuda -p 16 -n 32 --parallel 64 >/tmp/ncu.txt 2>&1
  cp /tmp/ncu.txt $OUT/ncu-$1-${3%%=*}.txt
  grep -E "^  [a-z]+_|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit Reg|Compute \(SM\) Throughput|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued" /tmp/ncu.txt | head -30
}
case $1 in
f)
  # The sums as floats without the conversion unit (imm Q4_K, the 32-blocks' imm / imv), kvd
  # over any number of rows (launches of 64, a narrower grid looping over the key ranges): the
  # exact-sum and attention op tests, the engine GPU tests (72 requests at once), the
  # architectures' parity, then default, QUIVER_CUDA_INT8_MMA=1, and
  # INT8_MMA=1 on .gpu/quiver-floor (imm split only while its parts fit the device's two
  # blocks per multiprocessor: floor, not ceil) on 8B Q4_K_M and Q4_0.
  (for ty in Q4_K_M Q4_0; do synth llama3-8b $ty $(f8 $ty); done) &
  for f in int8_mma attention; do
    el "op test $f"
    timeout 200 $B/test-gpu_ops --include-ignored --test-threads=1 --nocapture $f 2>&1 |
      grep -E "^test |attention|panicked|differ|result" | head -30
  done
  el "engine GPU tests"
  timeout 300 $B/test-gpu --include-ignored --test-threads=1 2>&1 | grep -E "^test |panicked|left|right|result" | head -30
  el "architectures"
  timeout 100 $B/test-archs --include-ignored gpu_matches 2>&1 | grep -E "panicked|result"
  for ty in Q4_K_M Q4_0; do
    wait_for $(f8 $ty)
    for e in "quiver X=1" "quiver QUIVER_CUDA_INT8_MMA=1" "quiver-floor QUIVER_CUDA_INT8_MMA=1"; do
      set -- $e
      [ $ty = Q4_0 ] && [ $1 = quiver-floor ] && continue
      el "8B $ty $1 $2"
      env $2 $B/$1 bench -m $(f8 $ty) --device cuda -p 512 -n 128 --parallel 1,8,64,128 2>/dev/null | grep "^| " | tail -4
    done
  done
  el done
  ;;
c)
  # mmvqc1 Q4_K's reduce-scatter over four iterations: the exact-sum op tests, the decode
  # step's kernels at 1 and 64 sequences, default against QUIVER_CUDA_INT8_MMA=1, and the bench.
  (synth llama3-8b Q4_K_M $(f8 Q4_K_M)) &
  el "op test int8_mma"
  timeout 200 $B/test-gpu_ops --include-ignored --test-threads=1 --nocapture int8_mma 2>&1 |
    grep -E "^test |panicked|differ|result" | head -30
  wait_for $(f8 Q4_K_M)
  for p in "1 2500 420" "64 3500 420"; do
    set -- $p
    for e in X=1 QUIVER_CUDA_INT8_MMA=1; do el "kernels @$1 $e"; kern_times Q4_K_M $1 $2 $3 $e; done
  done
  for e in X=1 QUIVER_CUDA_INT8_MMA=1; do
    el "8B Q4_K_M $e"
    env $e $B/quiver bench -m $(f8 Q4_K_M) --device cuda -p 512 -n 128 --parallel 1,8,64,128 2>/dev/null | grep "^| " | tail -4
  done
  el done
  ;;
r)
  synth llama3-8b Q4_K_M $(f8 Q4_K_M)
  for p in "128 4500 420" "1 2500 420"; do
    set -- $p
    for e in X=1 QUIVER_CUDA_INT8_MMA=1; do
      el "kernels @$1 $e"
      kern_times Q4_K_M $1 $2 $3 $e
    done
  done
  el done
  ;;
k)
  (synth llama3-8b Q4_K_M $(f8 Q4_K_M)) &
  el "op test int8_mma"
  timeout 200 $B/test-gpu_ops --include-ignored --test-threads=1 --nocapture int8_mma 2>&1 |
    grep -E "^test |panicked|differ|result" | head -30
  el "serving invariance"
  timeout 200 $B/test-gpu --include-ignored --test-threads=1 serving 2>&1 | grep -E "^test |panicked|left|right|result" | head -20
  wait_for $(f8 Q4_K_M)
  if [ "${NCU:-1}" = 1 ]; then
    for e in X=1 QUIVER_CUDA_INT8_MMA=1; do el "ncu $e"; ncu_imm Q4_K_M q4_k $e; done
  fi
  for e in X=1 QUIVER_CUDA_INT8_MMA=1; do el "kernels @1 $e"; kern_times Q4_K_M 1 2500 420 $e; done
  for round in 1 2; do
    for e in X=1 QUIVER_CUDA_INT8_MMA=1; do
      el "8B Q4_K_M $e"
      env $e $B/quiver bench -m $(f8 Q4_K_M) --device cuda -p 512 -n 128 --parallel 1,8,64,128 2>/dev/null | grep "^| " | tail -4
    done
  done
  el done
  ;;
esac
