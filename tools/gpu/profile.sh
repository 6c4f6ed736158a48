#!/usr/bin/env bash
# On the GPU machine: where a quiver step's time goes (Nsight Compute, graphs off).
#   tools/gpu/profile.sh [-k REGEX] MODEL [quiver bench arguments, e.g. -p 512 -n 0]
#     every launch's duration (of the kernels whose demangled name matches REGEX), summed by
#     kernel name and grid, largest first → $OUT/profile.csv (ncu's raw page) and the table
#   tools/gpu/profile.sh --sass [-k REGEX] [-c N] [-s N] MODEL [bench arguments]
#     the full set of sections of N launches (-c, default 1) of REGEX after skipping N (-s):
#     per launch, its sections ($OUT/details.txt) and the warp-stall samples per SASS
#     instruction ($OUT/sass.csv), summed by stall reason with the hottest instructions
# Each launch is serialized and measured alone: keep the run short (a model of few layers,
# `quiver synth --layers 2`, and -n 2; a whole 8B's decode step is ~250 launches). The bench
# runs its warm-up and one timed run (-r 1): both are counted. The kernels staged in
# .gpu/home (stage.sh --kernels) go into the machine's cache first, as bench.sh does.
set -euo pipefail
export PATH=/usr/local/cuda/bin:$PATH
export QUIVER_HOME=${QUIVER_HOME:-/tmp/quiver-home}
if [ -d .gpu/home/kernels ]; then
  mkdir -p "$QUIVER_HOME/kernels"
  cp -n .gpu/home/kernels/* "$QUIVER_HOME/kernels/"
fi
sass=0 filter="" count=1 skip=0
while [ $# -gt 0 ]; do
  case $1 in
    --sass) sass=1; shift ;;
    -k) filter=${2:?-k needs a regular expression}; shift 2 ;;
    -c) count=${2:?-c needs a count}; shift 2 ;;
    -s) skip=${2:?-s needs a count}; shift 2 ;;
    *) break ;;
  esac
done
model=${1:?usage: tools/gpu/profile.sh [--sass] [-k REGEX] [-c N] [-s N] MODEL [bench arguments]}
shift
out=${OUT:-/tmp/out}
mkdir -p "$out"
sel=()
[ -z "$filter" ] || sel=(--kernel-name-base demangled -k "regex:$filter")
run=(.gpu/quiver bench -m "$model" --device cuda -r 1 "$@")
if [ "$sass" = 0 ]; then
  QUIVER_CUDA_GRAPHS=0 ncu --clock-control none "${sel[@]}" --metrics gpu__time_duration.sum --csv --page raw \
    "${run[@]}" >"$out/profile.csv" 2>"$out/profile.err" || { tail -5 "$out/profile.err"; exit 1; }
else
  QUIVER_CUDA_GRAPHS=0 ncu --clock-control none "${sel[@]}" --launch-skip "$skip" --launch-count "$count" \
    --set full -o /tmp/profile -f "${run[@]}" >"$out/profile.err" 2>&1 || { tail -5 "$out/profile.err"; exit 1; }
  ncu -i /tmp/profile.ncu-rep --page details >"$out/details.txt"
  ncu -i /tmp/profile.ncu-rep --page source --csv --print-source sass >"$out/sass.csv"
fi
python3 - "$out" "$sass" <<'PY'
import csv, sys, collections
out, sass = sys.argv[1], sys.argv[2] == "1"

def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0

if not sass:
    rows = [r for r in csv.reader(open(out + "/profile.csv")) if r]
    start = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    head = rows[start]
    name, dur = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
    grid = head.index("Grid Size") if "Grid Size" in head else None
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(rows[start + 1][dur], 1.0)
    tot, cnt = collections.Counter(), collections.Counter()
    for r in rows[start + 2:]:
        if len(r) <= dur:
            continue
        k = r[name].split("(")[0].strip() + (" " + r[grid] if grid is not None else "")
        tot[k] += num(r[dur]) * scale
        cnt[k] += 1
    every = sum(tot.values())
    print(f"{'kernel (grid)':<56} {'launches':>8} {'µs each':>9} {'µs':>11} {'share':>7}")
    for k, t in tot.most_common():
        print(f"{k[:56]:<56} {cnt[k]:>8} {t / cnt[k]:>9.1f} {t:>11.1f} {100 * t / every:>6.1f}%")
    print(f"{'all':<56} {sum(cnt.values()):>8} {'':>9} {every:>11.1f}")
    sys.exit(0)

# The source page: a "Kernel Name" line, the header, then one row per SASS instruction, per
# profiled launch (some versions repeat a launch's block: the repeats are skipped).
blocks, cur = [], None
for r in csv.reader(open(out + "/sass.csv")):
    if r and r[0] == "Kernel Name":
        cur = {"name": r[1] if len(r) > 1 else "?", "rows": []}
        blocks.append(cur)
    elif cur is not None and r:
        cur["rows"].append(r)
seen = set()
for b in blocks:
    head, data = b["rows"][0], b["rows"][1:]
    key = (b["name"], tuple(tuple(r[:6]) for r in data[:50]))
    if key in seen or "Warp Stall Sampling (All Samples)" not in head:
        continue
    seen.add(key)
    samples = head.index("Warp Stall Sampling (All Samples)")
    executed = head.index("Instructions Executed")
    stalls = [i for i, h in enumerate(head) if h.startswith("stall_") and "Not Issued" not in h]
    every = sum(num(r[samples]) for r in data) or 1.0
    print(f"== {b['name'][:100]}")
    print(f"   {every:.0f} samples, {sum(num(r[executed]) for r in data):.0f} warp instructions executed")
    by = collections.Counter()
    for r in data:
        for i in stalls:
            by[head[i]] += num(r[i])
    print("   " + ", ".join(f"{k[6:]} {100 * v / every:.1f}%" for k, v in by.most_common(8)))
    for i, r in enumerate(data):
        s = num(r[samples])
        if s >= 0.01 * every:
            top = sorted(((num(r[j]), head[j][6:]) for j in stalls), reverse=True)[:2]
            why = ", ".join(f"{n} {v:.0f}" for v, n in top if v > 0)
            print(f"   {i:5} {100 * s / every:5.1f}% x{num(r[executed]):<8.0f} {r[1].strip()[:64]:<64} {why}")
PY
