#!/usr/bin/env bash
# The KV cache's element types (issue 17) on the GPU machine, with the binaries of
# tools/gpu/stage.sh in .gpu/:
#   tools/gpu/kv.sh tests          the kv op tests and the attention tests
#   tools/gpu/kv.sh ppl            SmolLM2 / Gemma 3 perplexity (GPL-3 copied to .gpu/) per type
#   tools/gpu/kv.sh depth SPEC     SPEC = arch:preset:type: quiver bench -d DEPTHS per type in
#                                  $TYPES (decode and prompt after DEPTHS tokens)
set -uo pipefail
B=.gpu
O=${OUT:-/tmp/out}
M=/tmp/quiver-models
export QUIVER_HOME=${QUIVER_HOME:-/tmp/quiver-home} RUST_BACKTRACE=1
mkdir -p "$M" "$O"
step=$1
shift
case $step in
  tests)
    $B/test-gpu_ops --include-ignored --test-threads=1 kv_ attention rope 2>&1 | grep -E -A3 "^test |panicked|result|error" | grep -v "^  *[0-9]*:" | head -${LINES_OUT:-80}
    ;;
  ppl)
    for m in "$@"; do
      for t in ${TYPES:-f16 q8_0 tq8 tq4}; do
        echo "== $(basename $m) $t"
        timeout 300 $B/quiver perplexity -m "$m" -f $B/GPL-3 -c ${CHUNK:-512} --device cuda --kv-type $t 2>&1 | grep -E "^PPL|quiver: [0-9]+ tokens|error"
      done
    done
    ;;
  depth)
    IFS=: read -r arch preset ty <<<"$1"
    f="$M/$preset-$ty.gguf"
    [ -s "$f" ] || /usr/bin/time -f "synth $preset $ty: %es" $B/quiver synth --arch "$arch" --preset "$preset" --type "$ty" -o "$f" >/dev/null
    # TYPES: KV types; a type:ENV=V entry runs with that variable (e.g. f16:QUIVER_CUDA_KVD=0).
    for spec in ${TYPES:-f16 q8_0 tq8 tq4}; do
      t=${spec%%:*}
      e=$([ "$t" = "$spec" ] || echo "${spec#*:}")
      for d in ${DEPTHS:-0 4096 16384}; do
        echo "-- $spec d$d"
        env $e timeout ${LIMIT:-120} $B/quiver bench -m "$f" --device cuda -p 512 -n 128 -r 2 -d $d --kv-type $t 2>>$O/bench.log | grep -E "^\| llama"
      done
    done
    ;;
esac
