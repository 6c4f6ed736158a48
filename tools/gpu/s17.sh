#!/usr/bin/env bash
# The seventeenth session's GPU work (issue 17: attention at depth), calls back to back on one
# warm machine. Here, first: tools/gpu/stage.sh && strip .gpu/quiver .gpu/test-*; the binary of
# the session's base commit as .gpu/quiver-base. Carry .gpu.
#   s17.sh a   op tests (int8_mma, the attention kernels, every KV type, prompts at depth over
#              every pair), engine GPU tests; then 8B Q4_K_M decode and prompt after 0 and 16k
#              tokens: kvp (default) against kvd (QUIVER_CUDA_KVP=0) and the base binary, f16,
#              tq8, tq4.
# Every call writes its log under $OUT too.
. "$(dirname "$0")/common.sh"
F=$(f8 Q4_K_M)
# One `quiver bench` at depth: binary, KV type, environment (X=1: none), depth; its table rows.
dep() {
  env $3 timeout 150 $1 bench -m $F --device cuda -p 512 -n 128 -r 2 -d $4 --kv-type $2 2>>$OUT/bench.log |
    grep -E "^\| llama" | sed "s/^/$2 $3 $(basename $1) d$4 /"
}
case $1 in
a)
  (synth llama3-8b Q4_K_M $F) &
  for f in int8_mma attention kv_ prompts_over; do optests $f; done
  enginetests
  wait_for $F
  for d in 0 16384; do
    el "depth $d"
    dep $B/quiver f16 X=1 $d
    dep $B/quiver f16 QUIVER_CUDA_KVP=0 $d
    dep $B/quiver-base f16 X=1 $d
    dep $B/quiver tq8 X=1 $d
    dep $B/quiver-base tq8 X=1 $d
    dep $B/quiver tq4 X=1 $d
  done
  el done
  ;;
p) # decode attention at 16k: kvp (f16, tq8) and kvd (f16), each over one decode step's 32
   # layers (graphs off), then Nsight Compute's sections for one launch.
  synth llama3-8b Q4_K_M $F
  for spec in "kvp f16 X=1" "kvp tq8 X=1" "kvd f16 QUIVER_CUDA_KVP=0"; do
    set -- $spec
    el "ncu $spec: 32 launches (one decode step's layers)"
    env $3 QUIVER_CUDA_GRAPHS=0 timeout 200 ncu --clock-control none --csv --page raw --metrics gpu__time_duration.sum -k regex:"$1_attention|kvd_merge" \
      --launch-skip 64 --launch-count 64 $B/quiver bench -m $F --device cuda -p 16 -n 8 -r 1 -d 16384 --kv-type $2 >/tmp/kt.csv 2>/dev/null
    kt_summary /tmp/kt.csv
    env $3 QUIVER_CUDA_GRAPHS=0 timeout 200 ncu --clock-control none -k regex:$1_attention --launch-skip 40 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \
      $B/quiver bench -m $F --device cuda -p 16 -n 8 -r 1 -d 16384 --kv-type $2 2>/dev/null | grep -vE "^==PROF|^\s*$|----" | tail -75 > $OUT/ncu-$1-$2.txt
    grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers|Block Limit|Stall|Warp Cycles|Issued|L1/TEX Hit|Mem Busy|Max Bandwidth" $OUT/ncu-$1-$2.txt | head -30
  done
  el done
  ;;
esac
