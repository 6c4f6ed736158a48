#!/usr/bin/env bash
# The architectures on the GPU machine (issue 14), with the binaries of tools/gpu/stage.sh in
# .gpu/ and llama.cpp's CUDA build from ../shared/tools/peer/device_peer.sh (carried in .peer/):
#   tools/gpu/archs.sh tests                 GPU op tests (MoE included) and every architecture's
#                                            tiny model against llama.cpp's fixtures on the GPU
#   tools/gpu/archs.sh synth PRESET:TYPE...  write the real-shape models to /tmp/peer
#   tools/gpu/archs.sh bench PRESET:TYPE...  quiver and llama.cpp on the same files, one run:
#                                            pp512/tg128, then --parallel 1,8,64 (S_TG)
set -uo pipefail
B=.gpu
export QUIVER_HOME=${QUIVER_HOME:-/tmp/quiver-home} RUST_BACKTRACE=1
O=${OUT:-/tmp/out}
W=/tmp/peer
mkdir -p "$O" "$W"
L=$W/llama.cpp/build/bin
step=$1
shift
case $step in
  tests)
    $B/test-kernels_compile 2>&1 | tail -2
    $B/test-gpu_ops --include-ignored --test-threads=1 2>&1 | grep -E "^test |panicked|result|moe:" | head -20
    $B/test-archs --include-ignored --test-threads=1 --nocapture 2>&1 | grep -E "max \||^test |panicked|result" | head -40
    $B/test-gpu --include-ignored --test-threads=1 2>&1 | grep -E "^test |panicked|result" | head -12
    ;;
  synth)
    for pt in "$@"; do
      p=${pt%%:*}; t=${pt##*:}
      [ -s "$W/$p-$t.gguf" ] || /usr/bin/time -f "synth $p $t: %es" $B/quiver synth --preset "$p" --type "$t" -o "$W/$p-$t.gguf" >/dev/null
    done
    ls -la $W/*.gguf
    ;;
  bench)
    for pt in "$@"; do
      p=${pt%%:*}; t=${pt##*:}; f=$W/$p-$t.gguf
      echo "== $p $t"
      $B/quiver bench -m "$f" --device cuda -p 512 -n 128 -r 3 2>>$O/bench.log
      [ -x $L/llama-bench ] && $L/llama-bench -m "$f" -ngl 99 -fa 1 -p 512 -n 128 -r 3 -o md 2>/dev/null | grep -E "^\|"
      $B/quiver bench -m "$f" --device cuda -p 512 -n 128 --parallel "${PAR:-1,8,64}" 2>>$O/bench.log
      [ -x $L/llama-batched-bench ] && $L/llama-batched-bench -m "$f" -c 40960 -b 2048 -ub 512 -npp 512 -ntg 128 -npl "${PAR:-1,8,64}" -ngl 99 -fa on 2>/dev/null | grep -E "^\|"
    done
    ;;
esac
