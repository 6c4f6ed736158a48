#!/usr/bin/env bash
# Runs on the GPU machine from the repo root, with the binaries tools/gpu/stage.sh put in
# .gpu/: op parity, graph replay, batched serving, GPU-vs-CPU on synthetic models, benches.
# PAR=1,8,… sets the widths of batched-8b.
# Usage: tools/gpu/checks.sh [tests] [compare] [exact] [bench-small] [bench-gemma] [bench-8b:TYPE...] [batched-8b:TYPE]
#        [ncu:TYPE] [ncu-pp:TYPE] [ncu-batched:TYPE:B] [noflash] [env:NAME=VALUE] [part:FILE...] [real:NAME...]
#   part:FILE  keeps a carried piece of a real model in /tmp/qparts (the models are larger than
#              one call carries: split them, carry one piece per call, back to back)
#   real:NAME  joins /tmp/qparts/NAME.part* and runs GPU-vs-CPU parity on the reference records
#              (.gpu/generate-NAME.jsonl) and the reference perplexity (.gpu/GPL-3) on both
set -uo pipefail
B=.gpu
export QUIVER_HOME=${QUIVER_HOME:-/tmp/quiver-home} RUST_BACKTRACE=1
M=/tmp/quiver-models
mkdir -p "$M" "${OUT:-/tmp/out}"
O=${OUT:-/tmp/out}
synth() { # arch preset type
  local f="$M/$2-$3.gguf"
  [ -s "$f" ] || { /usr/bin/time -f "synth $2 $3: %es" $B/quiver synth --arch "$1" --preset "$2" --type "$3" -o "$f" >/dev/null; }
  echo "$f"
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
for step in "$@"; do
  case $step in
    tests)
      $B/test-kernels_compile 2>&1 | tail -3
      $B/test-gpu_ops --include-ignored --test-threads=1 --nocapture 2>&1 | tee $O/gpu_ops.log | grep -E "^test |seed|panicked|error|result" | head -40
      $B/test-gpu --include-ignored --test-threads=1 2>&1 | grep -E "^test |panicked|error|result|Captures|\{" | head -20
      ;;
    compare)
      for spec in "llama smollm2-135m Q4_1" "gemma3 gemma3-270m Q4_K_M" "llama smollm2-135m F16" "llama smollm2-135m Q8_0" "llama smollm2-135m Q4_0"; do
        set -- $spec
        f=$(synth "$1" "$2" "$3")
        echo "compare $2 $3: $($B/quiver compare -m "$f" --device cuda -n 100 --decode 40 --json 2>>$O/compare.log)"
      done
      ;;
    exact)   # the parity mode against the CPU on synthetic models; op-by-op dump diff of the first
      for spec in "llama smollm2-135m Q4_1" "gemma3 gemma3-270m Q4_K_M"; do
        set -- $spec
        f=$(synth "$1" "$2" "$3")
        echo "exact compare $2 $3: $(QUIVER_CUDA_EXACT=1 $B/quiver compare -m "$f" --device cuda -n 40 --decode 8 --json 2>>$O/compare.log)"
        rm -rf /tmp/qdump && mkdir -p /tmp/qdump
        QUIVER_CUDA_EXACT=1 QUIVER_DUMP_DIR=/tmp/qdump $B/quiver compare -m "$f" --device cuda -n 6 --decode 0 --json >/dev/null 2>>$O/compare.log
        python3 tools/parity/dumpdiff.py /tmp/qdump | awk '$2 != 0' | head -8
      done
      ;;
    bench-small)
      f=$(synth llama smollm2-135m Q4_1)
      $B/quiver bench -m "$f" --device cuda -p 512 -n 128 -r 3 -v 2>>$O/bench.log
      ;;
    bench-gemma)   # Gemma3-270M shape (head dim 256, sliding window), with and without flash for 256
      f=$(synth gemma3 gemma3-270m Q4_K_M)
      $B/quiver compare -m "$f" --device cuda -n 100 --decode 16 --json 2>>$O/compare.log
      $B/quiver bench -m "$f" --device cuda -p 512 -n 128 -r 3 2>>$O/bench.log
      QUIVER_CUDA_FLASH_256=0 $B/quiver bench -m "$f" --device cuda -p 512 -n 128 -r 3 2>>$O/bench.log
      ;;
    bench-8b:*)
      t=${step#bench-8b:}
      f=$(synth llama llama3-8b "$t")
      $B/quiver compare -m "$f" --device cuda -n 64 --decode 8 --json 2>>$O/compare.log
      $B/quiver bench -m "$f" --device cuda -p 512 -n 128 -r 3 -v 2>>$O/bench.log
      ;;
    env:*)   # env:NAME=VALUE for the steps after this one
      export "${step#env:}"
      ;;
    noflash)
      export QUIVER_CUDA_FLASH=0   # the steps after this one use the split-K prefill attention
      ;;
    batched-8b:*)
      t=${step#batched-8b:}
      f=$(synth llama llama3-8b "$t")
      $B/quiver bench -m "$f" --device cuda -p 512 -n 128 --parallel "${PAR:-1,2,4,8,16,32,64,128}" -v 2>>$O/bench.log
      ;;
    ncu-batched:*)   # kernel time per decode step of B sequences, by kernel (graphs off)
      spec=${step#ncu-batched:}; t=${spec%%:*}; nb=${spec##*:}
      f=$(synth llama llama3-8b "$t")
      QUIVER_CUDA_GRAPHS=0 ncu --clock-control none --launch-skip 3000 --launch-count 1200 --metrics gpu__time_duration.sum \
        $B/quiver bench -m "$f" --device cuda -p 16 -n 64 --parallel "$nb" 2>&1 | grep -E "^  [a-zA-Z_0-9]+|gpu__time" | paste - - | awk -v B="$nb" '{u=$(NF-1); v=$NF; if (u=="ns") v/=1000; if (u=="ms") v*=1000; n=$1; if (n=="void") n=$2; n=substr(n,1,40); t[n]+=v; c[n]++; T+=v} END {for (k in t) printf "B=%s %-40s %5d launches %10.1f us\n", B, k, c[k], t[k]; printf "B=%s total %.1f us over 1200 launches\n", B, T}'
      ;;
    ncu:*)
      t=${step#ncu:}
      f=$(synth llama llama3-8b "$t")
      QUIVER_CUDA_GRAPHS=0 ncu --clock-control none -k regex:mmv --launch-skip 20 --launch-count 6 \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active \
        $B/quiver bench -m "$f" --device cuda -p 0 -n 4 -r 1 2>&1 | grep -E "mmv|gpu__time|dram__|sm__|l1tex" | head -60
      ;;
    ncu-pp:*)
      t=${step#ncu-pp:}
      f=$(synth llama llama3-8b "$t")
      ncu --clock-control none --launch-skip 700 --launch-count 40 --metrics gpu__time_duration.sum \
        $B/quiver bench -m "$f" --device cuda -p 512 -n 0 -r 1 2>&1 | grep -E "^  [a-zA-Z_0-9]+|gpu__time" | paste - - | awk '{u=$(NF-1); v=$NF; if (u=="ns") v/=1000; if (u=="ms") v*=1000; n=$1; if (n=="void") n=$2; n=substr(n,1,40); t[n]+=v; c[n]++} END {for (k in t) printf "%-40s %4d launches %10.1f us\n", k, c[k], t[k]}'
      ;;
    part:*)
      mkdir -p /tmp/qparts && cp "${step#part:}" /tmp/qparts/ && ls -la /tmp/qparts
      ;;
    real:*)
      n=${step#real:}
      cat /tmp/qparts/$n.part* > /tmp/$n.gguf && ls -la /tmp/$n.gguf
      # The default pair, then the parity mode (QUIVER_CUDA_EXACT=1, the CPU batch invariant);
      # REAL_ENV adds variants (e.g. QUIVER_CUDA_ACT_GRID=0 QUIVER_CUDA_TENSOR_CORES=0).
      for e in "" QUIVER_CUDA_EXACT=1 ${REAL_ENV:-}; do
        echo "compare [${e:-default}]: $(env $e $B/quiver compare -m /tmp/$n.gguf --device cuda -n 64 --decode 32 --reference .gpu/generate-$n.jsonl --json 2>>$O/real.log)"
      done
      [ "${NO_PPL:-0}" = 1 ] && continue   # NO_PPL=1: the top-1 comparisons only
      for d in cuda cpu; do
        echo "perplexity $d: $($B/quiver perplexity -m /tmp/$n.gguf -f .gpu/GPL-3 -c 512 --device $d 2>>$O/real.log | tail -1)"
      done
      for e in ${REAL_PPL_ENV:-}; do
        echo "perplexity cuda, $e: $(env $e $B/quiver perplexity -m /tmp/$n.gguf -f .gpu/GPL-3 -c 512 --device cuda 2>>$O/real.log | tail -1)"
      done
      ;;
  esac
done
