#!/usr/bin/env bash
# Builds the release binary and the GPU test binaries here (no CUDA toolkit needed) and copies
# them to .gpu/ (git-ignored), the folder a GPU-machine call carries. See docs/GPU.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release
mkdir -p .gpu
cp target/release/quiver .gpu/quiver
for t in "quiver-backend-cuda gpu_ops" "quiver-backend-cuda kernels_compile" "quiver-engine gpu" "quiver-engine archs"; do
  set -- $t
  exe=$(cargo test --release -p "$1" --test "$2" --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"]==["test"]: print(m["executable"])' | tail -1)
  cp "$exe" ".gpu/test-$2"
done
ls -la .gpu
