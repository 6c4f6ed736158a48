#!/usr/bin/env bash
# Here, before GPU calls: builds what the GPU machine runs (no CUDA toolkit needed) into .gpu/
# (git-ignored), the folder a call carries; tools/gpu/README.md says what to carry.
#   tools/gpu/stage.sh [--no-tests] [--old REV] [--peer] [--bundle] [--kernels "MODULE ..."]
#     always      the release binary → .gpu/quiver
#     (default)   the GPU test binaries → .gpu/test-{gpu_ops,kernels_compile,gpu,archs,llama_archs,gpu_spec,eagle3,mtp,gpu_tp}
#     --no-tests  not them (a bench call needs the quiver binaries alone)
#     --old REV   REV's release binary too → .gpu/quiver-old (REV's tree from git archive, built
#                 in target/stage-old with its own target folder: the first build is a full one)
#     --peer      llama.cpp's source for the peer build → .gpu/llama.cpp.tar.xz (peer.sh pack)
#     --bundle    the binaries (quiver, quiver-old, test-*) also in one .gpu/bundle.tar.xz (about a
#                 third of their size): carry it with .gpu/home and .gpu/stage.txt, and start the
#                 call with `tar xJf .gpu/bundle.tar.xz -C .gpu`
#     --kernels "MODULE ..."  those kernel modules compiled for sm_90 here → .gpu/home/kernels
#                 (bench.sh copies them into the machine's cache: no NVRTC compile there, ~15 s a
#                 module with wgmma kernels; the same NVRTC version on both sides, 13.0)
# Binaries are stripped; .gpu/stage.txt records what was built from which commit.
set -euo pipefail
self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/../.."
tests=1 old="" peer=0 kmods="" bundle=0
while [ $# -gt 0 ]; do
  case $1 in
    --no-tests) tests=0; shift ;;
    --old) old=${2:?--old needs a revision}; shift 2 ;;
    --peer) peer=1; shift ;;
    --bundle) bundle=1; shift ;;
    --kernels) kmods=${2:?--kernels needs module names}; shift 2 ;;
    *) sed -n '2,16p' "$self"; exit 2 ;;
  esac
done
mkdir -p .gpu
dirty=""
[ -z "$(git status --porcelain --untracked-files=no)" ] || dirty=" + uncommitted changes"
kept=""
[ -n "$old" ] || [ ! -f .gpu/quiver-old ] || kept=$(grep '^quiver-old:' .gpu/stage.txt 2>/dev/null || true)
echo "quiver: $(git log -1 --format='%h %s' | cut -c1-72)$dirty, staged $(date -u '+%F %H:%M') UTC" >.gpu/stage.txt
[ -z "$kept" ] || echo "$kept" >>.gpu/stage.txt

if [ -n "$old" ]; then
  rev=$(git rev-parse --verify "$old^{commit}")
  src=target/stage-old/src
  rm -rf "$src"
  mkdir -p "$src"
  git archive "$rev" | tar x -C "$src"
  # The same dependency versions as here where they still fit (Cargo.lock is not tracked).
  [ -f Cargo.lock ] && cp Cargo.lock "$src/"
  (cd "$src" && CARGO_TARGET_DIR=../target cargo build --release --bin quiver)
  cp target/stage-old/target/release/quiver .gpu/quiver-old
  strip .gpu/quiver-old
  echo "quiver-old: $(git log -1 --format='%h %s' "$rev" | cut -c1-72)" >>.gpu/stage.txt
fi

cargo build --release --bin quiver
cp target/release/quiver .gpu/quiver
strip .gpu/quiver

if [ "$tests" = 1 ]; then
  for t in "quiver-backend-cuda gpu_ops" "quiver-backend-cuda kernels_compile" "quiver-engine gpu" "quiver-engine archs" "quiver-engine llama_archs" "quiver-engine gpu_spec" "quiver-engine eagle3" "quiver-engine mtp" "quiver-engine gpu_tp"; do
    read -r pkg name <<<"$t"
    exe=$(cargo test --release -p "$pkg" --test "$name" --no-run --message-format=json 2>/dev/null |
      python3 -c 'import json, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["executable"])' | tail -1)
    [ -n "$exe" ] || { echo "stage.sh: no test binary for $pkg $name" >&2; exit 1; }
    cp "$exe" ".gpu/test-$name"
    strip ".gpu/test-$name"
  done
fi

[ "$peer" = 1 ] && bash tools/gpu/peer.sh pack
if [ -n "$kmods" ]; then
  rm -rf .gpu/home
  # shellcheck disable=SC2086 # the module names, one word each
  QUIVER_HOME=$PWD/.gpu/home QUIVER_CUDA_LIB_DIR="$(.venv/bin/python -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))')" \
    cargo run -q --release --example kernel_cache -p quiver-backend-cuda -- $kmods
  echo "kernels: $kmods" >>.gpu/stage.txt
fi
if [ "$bundle" = 1 ]; then
  (cd .gpu && rm -f bundle.tar.xz && tar cJf bundle.tar.xz quiver $(ls quiver-* test-* 2>/dev/null))
fi
cat .gpu/stage.txt
ls -la .gpu
# A call carries at most 64 MiB, the working tree (about 8 MiB) included.
total=$(du -sm .gpu | cut -f1)
[ "$total" -le 52 ] || echo "stage.sh: .gpu/ holds $total MiB: carry only what a call needs (tools/gpu/README.md)"
