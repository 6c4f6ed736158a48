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
b) # after kvf (tensor-core decode attention) and 2,048-key flash ranges: op tests, engine GPU
   # tests, then decode and prompt after 0, 16k and 32k tokens: kvf (default) against kvp and kvd
   # and the base binary (f16), kvf over tq8, tq4, q8_0; --parallel 16 after 4k.
  (synth llama3-8b Q4_K_M $F) &
  for f in attention kv_; do optests $f; done
  enginetests --skip real_models
  wait_for $F
  for d in 0 16384 32768; do
    el "depth $d"
    dep $B/quiver f16 X=1 $d
    dep $B/quiver f16 QUIVER_CUDA_DECODE_ATTN=kvp $d
    dep $B/quiver f16 QUIVER_CUDA_DECODE_ATTN=kvd $d
    [ $d = 0 ] || dep $B/quiver-base f16 X=1 $d
    for t in tq8 tq4 q8_0; do dep $B/quiver $t X=1 $d; done
  done
  for e in X=1 QUIVER_CUDA_DECODE_ATTN=kvd; do
    for t in f16 tq8; do
      el "parallel 16 after 4k, $t $e"
      env $e timeout 150 $B/quiver bench -m $F --device cuda -p 4096 -n 64 --parallel 16 --kv-type $t 2>/dev/null | grep "^| " | tail -1
    done
  done
  el done
  ;;
c) # the last minutes: Nsight Compute's sections for kvp at 16k (f16, tq8), then tq8 / tq4
   # after 32k and --parallel 16 after 4k (kvp against the base binary).
  synth llama3-8b Q4_K_M $F
  export QUIVER_CUDA_DECODE_ATTN=kvp
  for t in f16 tq8; do
    el "ncu kvp $t"
    QUIVER_CUDA_GRAPHS=0 timeout 100 ncu --clock-control none -k regex:kvp_attention --launch-skip 40 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
      $B/quiver bench -m $F --device cuda -p 16 -n 8 -r 1 -d 16384 --kv-type $t 2>/dev/null | grep -vE "^==PROF|^\s*$|----" > $OUT/ncu-kvp-$t.txt
    grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Block Limit|Warp Cycles Per Issued|L1/TEX Hit|Mem Busy|Max Bandwidth|Issue Slots|Compute \(SM\)" $OUT/ncu-kvp-$t.txt | head -24
  done
  for t in tq8 tq4; do dep $B/quiver $t X=1 32768; done
  for b in quiver quiver-base; do
    for t in f16 tq8; do
      el "parallel 16 after 4k, $t $b"
      timeout 100 $B/$b bench -m $F --device cuda -p 4096 -n 64 --parallel 16 --kv-type $t 2>/dev/null | grep "^| " | tail -1
    done
  done
  el done
  ;;
p) # decode attention at 16k: kvp (f16, tq8) and kvd (f16), each over one decode step's 32
   # layers (graphs off), then Nsight Compute's sections for one launch.
  synth llama3-8b Q4_K_M $F
  for spec in "kvf f16 X=1" "kvf tq8 X=1" "kvd f16 QUIVER_CUDA_DECODE_ATTN=kvd"; do
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
