# Sourced by the session scripts (tools/gpu/sNN.sh) on the GPU machine, from the repository
# root: the environment, elapsed time, synthetic files made once, Nsight Compute summaries.
set -uo pipefail
export PATH=/usr/local/cuda/bin:$PATH
export QUIVER_HOME=${QUIVER_HOME:-/tmp/quiver-home} RUST_BACKTRACE=1
B=.gpu
W=/tmp/peer
mkdir -p "$W"
t0=$(date +%s)
el() { echo "[$(($(date +%s) - t0))s] $*"; }
wait_for() { while [ ! -s "$1.done" ]; do sleep 2; done; }
synth() { # preset type file [seed]
  [ -s "$3" ] || $B/quiver synth --preset "$1" --type "$2" ${4:+--seed $4} -o "$3" >/dev/null 2>&1
  echo ok >"$3.done"
}
f8() { echo $W/llama3-8b-$1.gguf; }
# The op tests whose names hold `filter`, and every engine GPU test (args: test-binary flags).
optests() { # filter
  el "op test $1"
  timeout 300 $B/test-gpu_ops --include-ignored --test-threads=1 --nocapture $1 2>&1 |
    grep -E "^test |panicked|differ|result" | head -30
}
enginetests() { # [flags]
  el "engine GPU tests"
  timeout 300 $B/test-gpu --include-ignored --test-threads=1 "$@" 2>&1 | grep -E "^test |panicked|left|right|result" | head -40
}
# The 8B file of `type` (once synth made it): pp512 and S_TG at 1, 8, 64, 128 sequences under
# each environment given (X=1: none).
bench8() { # type env...
  local ty=$1; shift
  wait_for $(f8 $ty)
  for e in "$@"; do
    el "8B $ty $e"
    env $e $B/quiver bench -m $(f8 $ty) --device cuda -p 512 -n 128 --parallel 1,8,64,128 2>/dev/null | grep "^| " | tail -4
  done
}
# Kernel durations of `count` launches after `skip` (graphs off) of `quiver bench -p 16 -n 16`
# on the 8B file of `type`: total per kernel, top 14.
kern_times() { # type parallel skip count env
  env $5 QUIVER_CUDA_GRAPHS=0 timeout 130 ncu --clock-control none --csv --page raw --metrics gpu__time_duration.sum \
    --launch-skip $3 --launch-count $4 $B/quiver bench -m $(f8 $1) --device cuda -p 16 -n 16 --parallel $2 >/tmp/kt.csv 2>/dev/null
  cp /tmp/kt.csv $OUT/kt-$1-$2-${5%%=*}.csv
  kt_summary /tmp/kt.csv
}
# Nsight Compute's per-launch durations (CSV) summed per kernel, top 14.
kt_summary() {
  python3 - "$1" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
h = rows[0]; ki = h.index("Kernel Name"); mi = h.index("gpu__time_duration.sum")
tot, cnt = collections.Counter(), collections.Counter()
for r in rows[2:]:
    try: v = float(r[mi].replace(",", ""))
    except ValueError: continue
    name = r[ki].split("(")[0]; tot[name] += v; cnt[name] += 1
unit = rows[1][mi]
print(f"  total {sum(tot.values()):.1f} {unit} over {sum(cnt.values())} launches")
for k, v in tot.most_common(14): print(f"  {v:10.1f} {unit} {cnt[k]:5d}x {k}")
PY
}
