#!/usr/bin/env bash
# The tensor-core products over the GGUF blocks (issue 15) on the GPU machine, with the
# binaries of tools/gpu/stage.sh in .gpu/:
#   tools/gpu/qmm.sh tests                  product op tests (every type, batch invariance)
#   tools/gpu/qmm.sh regs                   ptxas' registers and spills of .gpu/*.cu (kernel_source)
#   tools/gpu/qmm.sh ncu SPEC               Nsight Compute over the first qmm / qmv launches
#   tools/gpu/qmm.sh peer                   llama.cpp's CUDA build (.peer/), in the foreground
#   tools/gpu/qmm.sh bench SPEC...          SPEC = arch:preset:type; quiver in each of $CFGS
#                                           (inv: the defaults; noinv: QUIVER_CUDA_INVARIANT=0;
#                                           copies: that and QUIVER_CUDA_F16_COPIES=1), and
#                                           llama.cpp when built: pp512/tg128, --parallel $PAR
set -uo pipefail
B=.gpu
O=${OUT:-/tmp/out}
M=/tmp/quiver-models
export QUIVER_HOME=${QUIVER_HOME:-/tmp/quiver-home} RUST_BACKTRACE=1
mkdir -p "$M" "$O"
L=/tmp/peer/llama.cpp/build/bin
step=$1
shift
case $step in
  tests)
    $B/test-gpu_ops --include-ignored --test-threads=1 matmul batch_invariant 2>&1 | grep -E "^test |panicked|result|differ|error" | head -30
    ;;
  regs)
    for m in .gpu/*.cu; do
      /usr/local/cuda/bin/nvcc -arch=sm_90 -cubin --resource-usage -o /dev/null "$m" 2>&1 | grep -A2 -E "Compiling entry.*qm[mv]_" | head -12
    done
    ;;
  ncu)
    # The qmm / qmv launches of one pp512 + tg run on SPEC's model, under Nsight Compute.
    IFS=: read -r arch preset ty <<<"$1"
    f="$M/$preset-$ty.gguf"
    [ -s "$f" ] || $B/quiver synth --arch "$arch" --preset "$preset" --type "$ty" -o "$f" >/dev/null
    ncu --clock-control none -k regex:"qm[mv]_" -c ${COUNT:-6} --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
      $B/quiver bench -m "$f" --device cuda -p 512 -n 4 -r 1 2>&1 | grep -vE "^\[" | tail -${LINES_OUT:-400}
    ;;
  peer)
    # In the foreground: a background process does not outlive its call (~6 min).
    OUT=$O bash .peer/device_peer.sh build 2>&1 | tail -3
    ;;
  bench)
    nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
    for spec in "$@"; do
      IFS=: read -r arch preset ty <<<"$spec"
      f="$M/$preset-$ty.gguf"
      [ -s "$f" ] || /usr/bin/time -f "synth $preset $ty: %es" $B/quiver synth --arch "$arch" --preset "$preset" --type "$ty" -o "$f" >/dev/null
      echo "== $preset $ty"
      for cfg in ${CFGS:-inv noinv copies}; do
        case $cfg in
          inv) env=() ;;
          noinv) env=(QUIVER_CUDA_INVARIANT=0) ;;
          copies) env=(QUIVER_CUDA_INVARIANT=0 QUIVER_CUDA_F16_COPIES=1) ;;
        esac
        echo "-- $cfg ${env[*]}"
        env "${env[@]}" $B/quiver bench -m "$f" --device cuda -p 512 -n 128 -r 3 2>>$O/bench.log
        env "${env[@]}" $B/quiver bench -m "$f" --device cuda -p 512 -n 128 --parallel "${PAR:-1,8,64}" 2>>$O/bench.log
        grep -h "device memory" $O/bench.log | tail -1
      done
      if [ -x $L/llama-bench ]; then
        echo "-- llama.cpp"
        $L/llama-bench -m "$f" -ngl 99 -fa 1 -p 512 -n 128 -r 3 -o md 2>/dev/null | grep -E "^\|"
        $L/llama-batched-bench -m "$f" -c 40960 -b 2048 -ub 512 -npp 512 -ntg 128 -npl "${PAR:-1,8,64}" -ngl 99 -fa on 2>/dev/null | grep -E "^\|"
      fi
    done
    ;;
esac
