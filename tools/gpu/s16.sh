#!/usr/bin/env bash
# The sixteenth session's GPU work (docs/GPU.md), calls back to back on one warm machine.
# Here, first: tools/gpu/stage.sh && strip .gpu/quiver .gpu/test-*. Carry .gpu/quiver,
# .gpu/test-gpu_ops, .gpu/test-gpu, .gpu/test-archs.
#   s16.sh n   the first call: Q4_1, Q5_0 and IQ4_NL's exact-sum kernels (mmvqc, imv, imm;
#              written after the fifteenth session's GPU time): the exact-sum op tests for every
#              int8 type (imm's split parts now added by atomics into self-clearing accumulators),
#              the engine GPU tests (Q4_1 serving as alone), then default against
#              QUIVER_CUDA_INT8_MMA=1 on 8B Q4_1 and Q4_K_M (pp512, S_TG at 1, 8, 64, 128)
# Every call writes its log under $OUT too.
. "$(dirname "$0")/common.sh"
case $1 in
n)
  (for ty in Q4_1 Q4_K_M; do synth llama3-8b $ty $(f8 $ty); done) &
  for f in int8_mma exact_sum; do
    optests $f
  done
  enginetests
  el "architectures"
  timeout 100 $B/test-archs --include-ignored gpu_matches 2>&1 | grep -E "panicked|result"
  for ty in Q4_1 Q4_K_M; do bench8 $ty X=1 QUIVER_CUDA_INT8_MMA=1; done
  el done
  ;;
m) # after `n`: imm's split accumulators laid out per tile (coalesced atomics; `n` measured
   # the first layout 12% slower at 64 than imm_sum), the 32-blocks' terms added in quads
   # ((t0 + t1) + (t2 + t3), one fix_of per quad): op tests, engine GPU tests, 8B Q4_0, Q4_1
   # and Q4_K_M default against QUIVER_CUDA_INT8_MMA=1, imm's kernels at 64 sequences.
  (for ty in Q4_0 Q4_1 Q4_K_M; do synth llama3-8b $ty $(f8 $ty); done) &
  optests int8_mma
  enginetests
  for ty in Q4_0 Q4_1 Q4_K_M; do bench8 $ty X=1 QUIVER_CUDA_INT8_MMA=1; done
  for e in X=1 QUIVER_CUDA_INT8_MMA=1; do el "kernels @64 Q4_0 $e"; kern_times Q4_0 64 3500 420 $e; done
  el done
  ;;
part) # one carried piece of the real models' tar (tools/gpu/s16.sh's `l`), kept in /tmp/qp
  mkdir -p /tmp/qp && cp .models/* /tmp/qp/ && ls -la /tmp/qp | tail -3
  ;;
l) # with the last piece and the binaries (gzip: .gpu/*.gz): the real SmolLM2 and Gemma3 into
   # QUIVER_HOME, then int8_mma on by default: op tests, every engine GPU test (issue 18's
   # widths on the 8B shape and the real models), the 64-client load test on the real SmolLM2
   # (16 answers alone and under load; default against QUIVER_CUDA_INT8_MMA=0), 8B Q4_K_M.
  mkdir -p $QUIVER_HOME/models && cat /tmp/qp/* .models/* | tar x -C $QUIVER_HOME/models && ls -la $QUIVER_HOME/models
  for f in $B/*.gz; do gunzip -f $f; done; chmod +x $B/*
  (synth llama3-8b Q4_K_M $(f8 Q4_K_M)) &
  optests int8_mma
  enginetests
  for e in X=1 QUIVER_CUDA_INT8_MMA=0; do
    el "load test, real SmolLM2, $e"
    env $e timeout 150 python3 tools/bench_server.py --model smollm2-135m --quiver $B/quiver --device cuda \
      --clients 64 --max-tokens 64 --requests-per-client 4 --invariance 16 2>&1 | tail -4
  done
  bench8 Q4_K_M X=1 QUIVER_CUDA_INT8_MMA=0
  el done
  ;;
s) # after `part` with the real SmolLM2's first piece, with its second (.models/s.01) and the
   # binaries (.gpu/*.gz): imm's parts of one chunk in rows of fewer than 8 (a small model's
   # products): op tests, engine GPU tests, the SmolLM2 shape Q4_1 and the real SmolLM2's
   # 64-client load test, default against QUIVER_CUDA_INT8_MMA=0.
  mkdir -p $QUIVER_HOME/models && cat /tmp/qp/s.* .models/s.* >$QUIVER_HOME/models/smollm2-135m.gguf
  for f in $B/*.gz; do gunzip -f $f; done; chmod +x $B/*
  S=$W/smollm2-Q4_1.gguf; synth smollm2-135m Q4_1 $S
  optests int8_mma
  enginetests --skip real_models
  for e in X=1 QUIVER_CUDA_INT8_MMA=0; do
    el "SmolLM2 shape Q4_1 $e"
    env $e $B/quiver bench -m $S --device cuda -p 128 -n 128 --parallel 1,8,64,128 2>/dev/null | grep "^| " | tail -4
  done
  for e in X=1 QUIVER_CUDA_INT8_MMA=0; do
    el "load test, real SmolLM2, $e"
    env $e timeout 150 python3 tools/bench_server.py --model smollm2-135m --quiver $B/quiver --device cuda \
      --clients 64 --max-tokens 128 --requests-per-client 16 --invariance 16 2>&1 | tail -4
  done
  el done
  ;;
p) # the profile of what is left (per-kernel durations of decode steps, default against
   # QUIVER_CUDA_INT8_MMA=0): the SmolLM2 shape Q4_1 at 64 sequences, 8B Q4_K_M at 128.
  (synth llama3-8b Q4_K_M $(f8 Q4_K_M)) &
  S=$W/smollm2-Q4_1.gguf; synth smollm2-135m Q4_1 $S
  for e in X=1 QUIVER_CUDA_INT8_MMA=0; do
    el "SmolLM2 shape Q4_1 @64 $e"
    env $e QUIVER_CUDA_GRAPHS=0 timeout 100 ncu --clock-control none --csv --page raw --metrics gpu__time_duration.sum \
      --launch-skip 5000 --launch-count 400 $B/quiver bench -m $S --device cuda -p 16 -n 64 --parallel 64 >/tmp/kt.csv 2>/dev/null
    kt_summary /tmp/kt.csv
  done
  wait_for $(f8 Q4_K_M)
  for e in X=1 QUIVER_CUDA_INT8_MMA=0; do el "8B Q4_K_M @128 $e"; kern_times Q4_K_M 128 4500 420 $e; done
  el done
  ;;
esac
