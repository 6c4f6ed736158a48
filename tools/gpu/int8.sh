#!/usr/bin/env bash
# The tenth session's unfinished GPU checks (docs/GPU.md, "The next GPU session", item 0), in
# two calls back to back on a warm machine. Here, first:
#   tools/gpu/stage.sh && strip .gpu/quiver .gpu/test-*
#   split -b 49M -d -a 1 ~/.cache/quiver/models/smollm2-135m.gguf .gpuparts/smol.part
#   cp /usr/share/common-licenses/GPL-3 tools/bench_server.py .gpu/
# Call 1 (carry .gpuparts/smol.part0 .gpu/test-gpu_ops .gpu/test-archs .gpu/test-gpu):
#   tools/gpu/int8.sh tests     every op test, the Gemma 4 Q8_0 variants, the engine GPU tests
# Call 2 (carry .gpuparts/smol.part1 .gpu/quiver .gpu/GPL-3 .gpu/bench_server.py):
#   tools/gpu/int8.sh timing    SmolLM2 perplexity (GPU per mode, CPU), the constrained-decoding
#                               server benchmark, QUIVER_CUDA_INT8_MMA on / off on 8B Q4_0 and
#                               Q8_0 (and Q4_K on the 1B shape), IQ4 decode on the 1B shape
# (carry takes 64 MiB: the binaries and a part do not all fit in one call.)
set -uo pipefail
export QUIVER_HOME=${QUIVER_HOME:-/tmp/quiver-home} RUST_BACKTRACE=1
O=${OUT:-/tmp/out}
M=/tmp/quiver-models
B=.gpu/quiver
mkdir -p "$M" "$O" /tmp/qparts
t0=$(date +%s)
el() { echo "[$(($(date +%s) - t0))s] $*"; }
case ${1:-} in
  tests)
    cp .gpuparts/smol.part0 /tmp/qparts/
    el "op tests"
    timeout 300 .gpu/test-gpu_ops --include-ignored --test-threads=1 >"$O/ops.txt" 2>&1
    grep -E "^test |result|panicked" "$O/ops.txt" | head -30
    grep -A3 panicked "$O/ops.txt" | head -20
    # Which path widens Gemma 4's Q8_0 gap (measured 0.76 dense, 2.04 MoE with INT8_MMA=1).
    for e in X=1 QUIVER_CUDA_INT8_MMA=1 QUIVER_CUDA_TENSOR_CORES=0 QUIVER_CUDA_INT8=0 QUIVER_CUDA_KVD=0; do
      el "gemma4 Q8_0, $e"
      env $e QUIVER_ARCHS=tiny-gemma4-Q8_0,tiny-gemma4moe-Q8_0,tiny-gemma3-Q8_0 timeout 60 \
        .gpu/test-archs --include-ignored gpu_matches 2>&1 | grep -E "max \|Δ" | grep -v " > " | sed 's/, top-1.*//'
    done
    el "engine GPU tests"
    timeout 200 .gpu/test-gpu --include-ignored --test-threads=1 2>&1 | grep -E "^test |result|panicked"
    ;;
  timing)
    cat /tmp/qparts/smol.part0 .gpuparts/smol.part1 >/tmp/smol.gguf
    (for t in Q4_0 Q8_0; do
       [ -s "$M/8b-$t.gguf" ] || $B synth --arch llama --preset llama3-8b --type $t -o "$M/8b-$t.gguf" >/dev/null 2>&1
     done
     for t in IQ4_XS IQ4_NL Q4_K_M; do
       [ -s "$M/1b-$t.gguf" ] || $B synth --preset llama3-1b --type $t -o "$M/1b-$t.gguf" >/dev/null 2>&1
     done
     touch "$M/synth.done") &
    for e in X=1 QUIVER_CUDA_INVARIANT=1 "QUIVER_CUDA_INVARIANT=1 QUIVER_CUDA_INT8_MMA=1"; do
      el "SmolLM2 perplexity, cuda, $e"
      env $e timeout 60 $B perplexity -m /tmp/smol.gguf -f .gpu/GPL-3 -c 512 --device cuda 2>&1 | grep PPL | tail -1
    done
    el "constrained decoding, server"
    for r in 1 2; do
      for mode in plain regex json; do
        case $mode in plain) a=() ;; regex) a=(--guided-regex "[a-z ]+") ;; json) a=(--guided-json) ;; esac
        echo "-- $mode, round $r"
        timeout 90 python3 .gpu/bench_server.py --quiver $B --model /tmp/smol.gguf --device cuda \
          --clients 1,16 --requests-per-client 3 --max-tokens 64 "${a[@]}" 2>&1 | grep -E "^\| [0-9]|rror"
      done
    done
    while [ ! -f "$M/synth.done" ]; do sleep 2; done
    for t in Q4_0 Q8_0; do
      for e in X=1 QUIVER_CUDA_INT8_MMA=1 QUIVER_CUDA_INVARIANT=1 "QUIVER_CUDA_INVARIANT=1 QUIVER_CUDA_INT8_MMA=1"; do
        el "8B $t, $e"
        env $e timeout 60 $B bench -m "$M/8b-$t.gguf" --device cuda -p 512 -n 128 -r 2 2>/dev/null | grep "^| llama"
        env $e timeout 60 $B bench -m "$M/8b-$t.gguf" --device cuda -p 512 -n 128 --parallel 8,64 2>/dev/null | grep "^| llama" | tail -2
      done
    done
    for t in IQ4_XS IQ4_NL; do
      el "1B $t"
      timeout 60 $B bench -m "$M/1b-$t.gguf" --device cuda -p 512 -n 128 -r 2 2>/dev/null | grep "^| llama"
    done
    for e in X=1 QUIVER_CUDA_INT8_MMA=1; do
      el "1B Q4_K_M, $e"
      env $e timeout 60 $B bench -m "$M/1b-Q4_K_M.gguf" --device cuda -p 512 -n 128 -r 2 2>/dev/null | grep "^| llama"
    done
    el "SmolLM2 perplexity, cpu"
    timeout 100 $B perplexity -m /tmp/smol.gguf -f .gpu/GPL-3 -c 512 --device cpu 2>&1 | grep PPL | tail -1
    ;;
  *)
    sed -n 2,13p "$0"
    exit 2
    ;;
esac
el done
