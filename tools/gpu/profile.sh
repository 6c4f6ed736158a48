#!/usr/bin/env bash
# On the GPU machine: where a quiver step's time goes, kernel by kernel (Nsight Compute's
# duration of every launch, graphs off), summed by kernel name, largest first.
#   tools/gpu/profile.sh MODEL [quiver bench arguments, e.g. -p 512 -n 0]
# → $OUT/profile.csv (ncu's raw page) and the table on stdout: kernel, launches, total µs, share.
# The bench runs its warm-up and one timed run (-r 1): both are counted.
set -euo pipefail
export PATH=/usr/local/cuda/bin:$PATH
model=${1:?usage: tools/gpu/profile.sh MODEL [bench arguments]}
shift
out=${OUT:-/tmp/out}
mkdir -p "$out"
QUIVER_CUDA_GRAPHS=0 ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
  .gpu/quiver bench -m "$model" --device cuda -r 1 "$@" >"$out/profile.csv" 2>"$out/profile.err" ||
  { tail -5 "$out/profile.err"; exit 1; }
python3 - "$out/profile.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
start = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
head = rows[start]
name, dur = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
unit = rows[start + 1][dur]
scale = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "nsecond": 1e-3}.get(unit, 1.0)
tot, cnt = collections.Counter(), collections.Counter()
for r in rows[start + 2:]:
    if len(r) <= dur:
        continue
    try:
        t = float(r[dur].replace(",", "")) * scale
    except ValueError:
        continue
    k = r[name].split("(")[0].strip()
    tot[k] += t
    cnt[k] += 1
all_us = sum(tot.values())
print(f"{'kernel':<48} {'launches':>8} {'µs':>12} {'share':>7}")
for k, t in tot.most_common():
    print(f"{k[:48]:<48} {cnt[k]:>8} {t:>12.1f} {100 * t / all_us:>6.1f}%")
print(f"{'all':<48} {sum(cnt.values()):>8} {all_us:>12.1f}")
PY
