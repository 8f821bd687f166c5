#!/usr/bin/env bash
# One batched run on the GPU machine: build, GPU tests, JIT checks, benchmarks. Logs under $OUT.
#   bash benchmarks/run_device.sh "tests jit bench sweep"     (stages to run, in order)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jm-out}
mkdir -p "$OUT"
STAGES=${1-"tests jit bench"}  # an empty argument runs no stage (setup only)
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
else  # .whl/ is git-ignored: the device tool copies it only when the call carries it (carry: [".whl"])
  echo "run_device: no .whl/ here, so the peers it holds (humming-kernels, gemlite) are skipped; carry .whl" >&2
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export JITMARLIN_CACHE_DIR=${JITMARLIN_CACHE_DIR:-/tmp/jm-cache}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
python3 -m jitmarlin info > "$OUT/info.txt" 2>&1; tail -5 "$OUT/info.txt"
for st in $STAGES; do
  t0=$(date +%s)
  case $st in
    cmd)   # CMD: any command line, run after the setup above (PYTHONPATH, cache dir, peers' wheels)
           eval "${CMD:?cmd stage: set CMD}";;
    tests) # PYTEST_K: a -k expression (may hold spaces); PYTEST_ARGS: more words for pytest; TESTS_PATHS: what to
           # collect (default tests/gpu). A cold machine builds every family the suite touches: in session 40 the
           # whole suite did not finish in 420 s (644 of 727 tests), so split it over two calls, e.g. TESTS_PATHS=
           # "tests/gpu --ignore=tests/gpu/test_wgmma_gpu.py" (587 tests) and then tests/gpu/test_wgmma_gpu.py (140)
           timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -rs --maxfail=40 ${TESTS_PATHS:-tests/gpu} ${PYTEST_K:+-k "$PYTEST_K"} \
             ${PYTEST_ARGS:-} > "$OUT/tests.log" 2>&1
           echo "tests rc=$?"; tail -25 "$OUT/tests.log";;
    cputests) timeout 300 python3 -m pytest -q tests --ignore=tests/gpu -x > "$OUT/cputests.log" 2>&1
           echo "cputests rc=$?"; tail -3 "$OUT/cputests.log";;
    jit)   timeout 300 python3 benchmarks/bench_jit.py --json "$OUT/jit.json" > "$OUT/jit.log" 2>&1
           echo "jit rc=$?"; tail -2 "$OUT/jit.log";;
    bench) timeout ${BENCH_TIMEOUT:-420} python3 benchmarks/bench_gemm.py --json "$OUT/gemm.json" ${BENCH_ARGS:-} > "$OUT/gemm.log" 2>&1
           echo "bench rc=$?"; grep -v "^done" "$OUT/gemm.log" | tail -60;;
    sweep) timeout ${SWEEP_TIMEOUT:-300} python3 benchmarks/bench_gemm.py --sweep --peers none --json "$OUT/sweep.json" \
             --shapes ${SWEEP_SHAPES:-8192x28672,4096x4096,8192x8192} --m ${SWEEP_M:-1,16,32,64} > "$OUT/sweep.log" 2>&1
           echo "sweep rc=$?"; tail -20 "$OUT/sweep.log";;
    prof)  for spec in ${PROF_SPECS:-8192,28672,1 8192,28672,16 4096,4096,1}; do  # K,N,M triples
             IFS=, read -r k n m <<< "$spec"; set -- $k $n $m
             timeout 120 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
               --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
               --section InstructionStats --section SourceCounters \
               --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -k regex:jm_gemm -s 2 -c 1 \
               python3 benchmarks/profile_gemm.py --k $1 --n $2 --m $3 > "$OUT/prof_$1_$2_$3.txt" 2>&1
             echo "prof $spec rc=$?"; grep -E "Duration|Throughput|Registers|Achieved Occupancy|Stall|Issued Ipc|No Eligible" "$OUT/prof_$1_$2_$3.txt" | head -30
             grep -E "issue_stalled" "$OUT/prof_$1_$2_$3.txt" | sort -k3 -g -r | head -12  # stall cycles per issued instruction, by reason
           done;;
    demo)  timeout 240 python3 -m jitmarlin demo > "$OUT/demo.log" 2>&1
           echo "demo rc=$?"; tail -12 "$OUT/demo.log";;
    gpu2)  timeout 240 python3 -m pytest -q -rs tests/gpu -k "non_current or second_device" > "$OUT/gpu2.log" 2>&1
           echo "gpu2 rc=$?"; tail -5 "$OUT/gpu2.log";;
    ab)    timeout 200 python3 benchmarks/bench_gemm.py --json "$OUT/ab_default.json" --variants none \
             --shapes 8192x28672,8192x8192,4096x4096 --m 1,16 --peers humming > "$OUT/ab_default.log" 2>&1
           echo "ab default rc=$?"; grep -E "^\| [0-9]" "$OUT/ab_default.log"
           JITMARLIN_NVCC_FLAGS=-DJM_NO_SCALE_ACC timeout 100 python3 benchmarks/bench_gemm.py --json "$OUT/ab_noscale.json" \
             --variants none --shapes 8192x28672,8192x8192,4096x4096 --m 1,16 --peers none > "$OUT/ab_noscale.log" 2>&1
           echo "ab no-scale-acc rc=$?"; grep -E "^\| [0-9]" "$OUT/ab_noscale.log";;
    pdl)   timeout 200 python3 benchmarks/bench_gemm.py --json "$OUT/pdl_on.json" --variants none \
             --shapes ${PDL_SHAPES:-8192x28672,28672x8192,4096x28672,8192x8192,4096x4096} --m 1,16 \
             --peers ${PDL_PEERS:-humming,torch_int4} > "$OUT/pdl_on.log" 2>&1
           echo "pdl on rc=$?"; grep -E "^\| [0-9]" "$OUT/pdl_on.log"
           JITMARLIN_PDL=0 timeout 120 python3 benchmarks/bench_gemm.py --json "$OUT/pdl_off.json" --variants none \
             --shapes ${PDL_SHAPES:-8192x28672,28672x8192,4096x28672,8192x8192,4096x4096} --m 1,16 --peers none \
             > "$OUT/pdl_off.log" 2>&1
           echo "pdl off rc=$?"; grep -E "^\| [0-9]" "$OUT/pdl_off.log";;
    ab16)  # activations of the 16-row bulk tiles: cp.async (default) vs bulk row copies, M = 1 / 9 / 16,
           # with compute and stream-only; and the 5-stage w16 ring (a tile outside the built-in list)
           for f in "" -DJM_A_BULK_ROWS "-DJM_STREAM_ONLY" "-DJM_STREAM_ONLY -DJM_A_BULK_ROWS"; do
             JITMARLIN_NVCC_FLAGS="$f" timeout 150 python3 benchmarks/probe_configs.py \
               --shapes ${AB_SHAPES:-8192x28672,28672x8192,4096x28672,8192x8192} --m 1,9,16 \
               --configs w16_k128_s4_bk-w4,m1_k128_s4_bk-w4,w8_k128_s6_bk-w4 2>&1 | grep -v "^done" | tee -a "$OUT/ab16.log"
           done
           timeout 100 python3 benchmarks/probe_configs.py --shapes ${AB_SHAPES:-8192x28672,28672x8192,4096x28672,8192x8192} \
             --m 16 --extra-tiles w16_k128_s5_bk --configs w16_k128_s4_bk-w4,w16_k128_s5_bk-w4 2>&1 | grep -v "^done" \
             | tee -a "$OUT/ab16.log";;
    direct) # direct-load tiles (weights straight into registers, a few tiles ahead) vs the default
           # bulk-copy tiles at M <= 8; the probe prints each config's error against the reference
           timeout 200 python3 benchmarks/probe_configs.py \
             --shapes ${DIRECT_SHAPES:-8192x28672,28672x8192,4096x28672,8192x8192,4096x4096} --m 1,4,8 \
             --extra-tiles w8_k64_s8_bk_dr4,w8_k128_s6_bk_dr2,w8_k64_s8_bk_dr2 \
             --configs w8_k128_s6_bk-w4,w8_k128_s6_bk_ks2-w4,w8_k64_s8_bk_dr4-w4,w8_k64_s8_bk_dr4-w2,w8_k128_s6_bk_dr2-w4,w8_k64_s8_bk_dr2-w4 \
             2>&1 | grep -v "^done" | tee "$OUT/direct.log";;
    tune7) # session-7 candidates: deeper w16 rings at M = 9-16, direct-load tiles at M <= 8, 8-bit rings
           S6=4096x4096,4096x28672,14336x4096,8192x8192,8192x28672,28672x8192
           P="timeout 150 python3 benchmarks/probe_configs.py --shapes $S6"
           $P --m 9,16 --extra-tiles w16_k128_s5_bk,m1_k128_s5_bk,w16_k64_s10_bk \
             --configs w16_k128_s4_bk-w4,w16_k128_s5_bk-w4,m1_k128_s5_bk-w4,w16_k64_s10_bk-w4,m1_k128_s6-w4 \
             2>&1 | grep -v "^done" | tee "$OUT/tune7_m16.log"
           $P --m 1,4,8 --extra-tiles w8_k128_s6_bk_dr2,w8_k128_s4_bk_dr2 \
             --configs w8_k128_s6_bk-w4,w8_k128_s6_bk_ks2-w4,w8_k128_s6_bk_dr2-w4,w8_k128_s4_bk_dr2-w4 \
             2>&1 | grep -v "^done" | tee "$OUT/tune7_m1.log"
           $P --bits 8 --m 1,16 --extra-tiles w16_k128_s5_bk,w16_k64_s6_bk,w8_k64_s6_bk \
             --configs w8_k128_s6_bk-w4,w8_k64_s6_bk-w4,w16_k128_s4_bk-w4,w16_k128_s5_bk-w4,w16_k64_s6_bk-w4 \
             2>&1 | grep -v "^done" | tee "$OUT/tune7_u8.log";;
    bf16) # bf16 activations on the session-7 routes (direct-load tile, five-slot w16 ring) vs the rings
           timeout 150 python3 benchmarks/probe_configs.py --dtype bf16 --shapes 4096x28672,8192x8192,8192x28672,28672x8192 \
             --m 1,8,16 --configs w8_k128_s6_bk-w4,w8_k128_s6_bk_dr2-w4,w16_k128_s4_bk-w4,w16_k128_s5_bk-w4 \
             2>&1 | grep -v "^done" | tee "$OUT/bf16.log"
           timeout 150 python3 benchmarks/bench_gemm.py --json "$OUT/variants.json" --m 1,16 --peers none \
             --shapes 4096x28672,8192x8192,8192x28672,28672x8192 > "$OUT/variants.log" 2>&1
           echo "variants rc=$?"; grep -E "^\| [0-9]" "$OUT/variants.log";;
    actorder) # act-order at small M: layer vs GEMM alone vs gather alone; PDL on/off; the 4-slot w16 ring
           for env in "JITMARLIN_PDL=1" "JITMARLIN_PDL=0"; do
             env $env timeout 100 python3 benchmarks/probe_act_order.py --m 1,8,16 2>&1 | grep -v "^done" | tee -a "$OUT/actorder.log"
           done
           for g in 0 1; do
             timeout 100 python3 benchmarks/probe_act_order.py --m 1,8,16 --gather-pdl $g 2>&1 | grep -v "^done" | tee -a "$OUT/actorder.log"
           done
           timeout 100 python3 benchmarks/probe_act_order.py --m 16 --w16-stages 4 2>&1 | grep -v "^done" | tee -a "$OUT/actorder.log";;
    tune7b) # second round: direct-load 16-row tiles at M = 9-16, deeper direct prefetch at M <= 8,
           # bulk-copy 32-row tiles and the w16 ring at M = 32 / 64
           S6=4096x4096,4096x28672,14336x4096,8192x8192,8192x28672,28672x8192
           P="timeout 150 python3 benchmarks/probe_configs.py --shapes $S6"
           $P --m 16 --extra-tiles w16_k128_s6_bk_dr1,w16_k128_s6_bk_dr2 \
             --configs w16_k128_s5_bk-w4,w16_k128_s6_bk_dr1-w4,w16_k128_s6_bk_dr2-w4,w16_k128_s5_bk-w2 \
             2>&1 | grep -v "^done" | tee "$OUT/tune7b_m16.log"
           $P --m 1,8 --extra-tiles w8_k128_s6_bk_dr3 \
             --configs w8_k128_s6_bk_dr2-w4,w8_k128_s6_bk_dr3-w4,w8_k128_s6_bk_dr2-w2 \
             2>&1 | grep -v "^done" | tee "$OUT/tune7b_m1.log"
           $P --m 32,64 --extra-tiles m2_k128_s4_bk,m2_k64_s6_bk \
             --configs m2_k128_s4-w4,m2_k128_s4-w2,m2_k128_s4_bk-w4,m2_k64_s6_bk-w4,w16_k128_s5_bk-w4 \
             2>&1 | grep -v "^done" | tee "$OUT/tune7b_m32.log";;
    gap)   # where the M=1 kernel loses to a plain stream (38 vs ~30 us on 8192x28672): duration, DRAM
           # bytes and throughput, SM active cycles (min / avg / max: start-up and tail), for the GEMM,
           # its stream-only build and the stream probe's GEMM-shaped bulk ring
           GM="gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed"
           GM="$GM,sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,gpc__cycles_elapsed.max"
           GM="$GM,launch__grid_size,launch__registers_per_thread,smsp__inst_executed.sum"
           for f in "" -DJM_STREAM_ONLY; do
             JITMARLIN_NVCC_FLAGS="$f" timeout 150 ncu --clock-control none --metrics "$GM" -k regex:jm_gemm -s 2 -c 1 \
               python3 benchmarks/profile_gemm.py --k 8192 --n 28672 --m 1 > "$OUT/gap_gemm${f}.txt" 2>&1
             echo "gap gemm [$f] rc=$?"; grep -E "jm_gemm|__" "$OUT/gap_gemm${f}.txt" | tail -12
           done
           nvcc -std=c++17 -O3 -arch=sm_90a -I cuda_src benchmarks/stream_probe.cu -o /tmp/stream_probe \
             && timeout 150 ncu --clock-control none --metrics "$GM" -k regex:bulk_kernel -c 1 /tmp/stream_probe \
               > "$OUT/gap_probe.txt" 2>&1
           echo "gap probe rc=$?"; grep -E "bulk_kernel|__" "$OUT/gap_probe.txt" | tail -12;;
    stream) # how fast each weight-stream mechanism reads HBM at the GEMM's occupancies (plain CUDA, no torch)
           nvcc -std=c++17 -O3 -arch=sm_90a -I cuda_src benchmarks/stream_probe.cu -o /tmp/stream_probe \
             && timeout 120 /tmp/stream_probe > "$OUT/stream.log" 2>&1; echo "stream rc=$?"; cat "$OUT/stream.log";;
    moe)   timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_moe.py --json "$OUT/moe.json" > "$OUT/moe.log" 2>&1
           echo "moe rc=$?"; tail -30 "$OUT/moe.log";;
    readme) timeout 240 python3 -m pytest -q -rs tests/test_readme.py > "$OUT/readme.log" 2>&1
           echo "readme rc=$?"; tail -3 "$OUT/readme.log";;
    examples) ex=0
           for cmd in "examples/quantize_hf_model.py" "examples/quantize_hf_model.py --arch mixtral --layers 2" \
                      "examples/load_gptq_checkpoint.py --synthetic" "examples/moe_custom_model.py"; do
             echo "== $cmd" >> "$OUT/examples.log"
             timeout 240 python3 $cmd >> "$OUT/examples.log" 2>&1; rc=$?; echo "example $cmd rc=$rc"; [ $rc = 0 ] || ex=1
           done
           timeout 300 bash examples/prebuild_cache.sh /tmp/jm-prebuilt >> "$OUT/examples.log" 2>&1; echo "prebuild rc=$?"
           tail -15 "$OUT/examples.log";;
    moeutil) JITMARLIN_MOE_KERNELS=0 timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_moe.py --json "$OUT/moe_torch_align.json" \
             > "$OUT/moe_torch_align.log" 2>&1; echo "moe bench (torch align/silu, JITMARLIN_MOE_KERNELS=0) rc=$?"; tail -12 "$OUT/moe_torch_align.log";;
    wgmma) # configs of the sm_90a kernel, and the whole benchmarks with it everywhere (JITMARLIN_WGMMA=1)
           timeout 200 python3 benchmarks/probe_configs.py --shapes ${WGMMA_SHAPES:-4096x4096,8192x28672,28672x8192} \
             --m ${WGMMA_M:-64,256,1024} --extra-wgmma 128-2-4 --configs ${WGMMA_CONFIGS:-wgmma-n64-f1-s6,wgmma-n64-f2-s4,wgmma-n128-f1-s4,wgmma-n128-f2-s4} \
             > "$OUT/wgmma_probe.log" 2>&1; echo "wgmma probe rc=$?"; grep -v "^done" "$OUT/wgmma_probe.log"
           JITMARLIN_WGMMA=1 timeout 240 python3 benchmarks/bench_gemm.py --m 64,256,1024 --peers humming --variants none \
             --json "$OUT/wgmma_bench.json" > "$OUT/wgmma_bench.log" 2>&1; echo "wgmma bench rc=$?"; grep -E "^\| [0-9]" "$OUT/wgmma_bench.log"
           JITMARLIN_WGMMA=1 timeout 200 python3 benchmarks/bench_moe.py --json "$OUT/wgmma_moe.json" > "$OUT/wgmma_moe.log" 2>&1
           echo "wgmma moe bench rc=$?"; tail -14 "$OUT/wgmma_moe.log";;
    s8a)   # session 8: 8-bit rings with 8 math warps (latency hiding at one CTA/SM), the act-order pair
           # before fusing the gather, the bf16 block with and without idle time before each block
           timeout 200 python3 benchmarks/probe_configs.py --bits 8 --shapes 4096x28672,8192x8192,8192x28672,28672x8192 \
             --m 1,16 --extra-tiles w8_k64_s6_bk,w8_k128_s3_bk,w16_k64_s6_bk,w16_k128_s6_bk \
             --configs w8_k128_s6_bk-w4,w8_k64_s6_bk-w8,w8_k128_s3_bk-w8,w16_k128_s5_bk-w4,w16_k64_s6_bk-w8,w16_k128_s6_bk-w4 \
             2>&1 | grep -v "^done" | tee "$OUT/s8a_u8.log"
           timeout 100 python3 benchmarks/probe_act_order.py --m 1,16 --shapes 28672x8192,8192x28672,8192x8192,4096x4096 \
             2>&1 | grep -v "^done" | tee "$OUT/s8a_actorder.log"
           for st in 0 0.5; do
             timeout 150 python3 benchmarks/bench_gemm.py --shapes 4096x28672,8192x28672 --m 1,16,1024 --peers none \
               --variants bf16 --variant-m 1,16 --settle $st --json "$OUT/s8a_settle$st.json" > "$OUT/s8a_settle$st.log" 2>&1
             echo "settle $st rc=$?"; grep -E "^\| [0-9]|gpu state" "$OUT/s8a_settle$st.log"
           done;;
    s8c)   # session 8: fewer CTAs than fit (fewer split units, shorter reductions) where the problem is
           # small for the GPU: 4096^2 at M=1, 8192^2 / 14336x4096 at M=16; MoE block sizes with the new tiles
           P="timeout 150 python3 benchmarks/probe_configs.py"
           $P --shapes 4096x4096 --m 1,8 --configs w8_k128_s6_bk_ks2-w4,w8_k128_s6_bk_ks2-w4-g198,w8_k128_s6_bk_ks2-w4-g132,w8_k128_s6_bk_ks2-w4-g96,w8_k128_s6_bk_ks2-w4-g66,w8_k128_s6_bk_ks2-w2-g132,w8_k128_s6_bk-w2,w8_k128_s6_bk-w2-g132,w8_k128_s6_bk_dr2-w2,w8_k128_s6_bk_dr2-w4-g132 \
             2>&1 | grep -v "^done" | tee "$OUT/s8c_small.log"
           $P --shapes 8192x8192,14336x4096,4096x28672 --m 16 --configs w16_k128_s5_bk-w4,w16_k128_s5_bk-w4-g198,w16_k128_s5_bk-w4-g132,w16_k128_s5_bk-w2,w16_k128_s5_bk-w2-g132,m1_k128_s6-w4,m1_k128_s6-w4-g96,m1_k128_s6-w2 \
             2>&1 | grep -v "^done" | tee "$OUT/s8c_m16.log"
           $P --shapes 8192x28672,8192x8192 --m 1 --configs w8_k128_s6_bk_dr2-w4,w8_k128_s6_bk_dr2-w4-g198,w8_k128_s6_bk_dr2-w4-g132 \
             2>&1 | grep -v "^done" | tee "$OUT/s8c_m1.log"
           timeout 200 python3 benchmarks/bench_moe.py --tokens 1,16,64 --blocks 8,16,32,64 > "$OUT/s8c_moe.log" 2>&1
           echo "moe blocks rc=$?"; grep -E "by block" "$OUT/s8c_moe.log";;
    s8d)   # session 8: k-split 16-row rings at M=16 (8 math warps, one ring), and the MoE chain with
           # programmatic launch after the align and around silu_mul
           timeout 150 python3 benchmarks/probe_configs.py --shapes 8192x8192,14336x4096,4096x28672,8192x28672,28672x8192 \
             --m 16 --extra-tiles w16_k128_s4_bk_ks2,w16_k128_s5_bk_ks2 \
             --configs w16_k128_s5_bk-w4,w16_k128_s4_bk_ks2-w4,w16_k128_s5_bk_ks2-w4 2>&1 | grep -v "^done" | tee "$OUT/s8d_ks.log"
           timeout 200 python3 benchmarks/bench_moe.py --tokens 1,16,64 --json "$OUT/s8d_moe.json" > "$OUT/s8d_moe.log" 2>&1
           echo "moe rc=$?"; grep -E "^\| (mixtral|e64)" "$OUT/s8d_moe.log";;
    s9a)   # session 9: the prep-session9 pieces one by one (second GEMM before SiLU-mul ends, our
           # top-k sum), then MoE block sizes on the large-problem routes at 32-128 tokens
           P="timeout 100 python3 benchmarks/probe_moe_tiles.py"
           for a in "" "--ready-tables 0" "--torch-sum" "--ready-tables 0 --torch-sum"; do
             $P --tokens 1,16 $a 2>&1 | grep "^\[" | tee -a "$OUT/s9a_pieces.log"
           done
           for b in 8 16 32; do
             $P --tokens 32,64,128 --block $b 2>&1 | grep "^\[" | tee -a "$OUT/s9a_blocks.log"
           done
           $P --tokens 32,64,128 2>&1 | grep "^\[" | tee -a "$OUT/s9a_blocks.log"
           JITMARLIN_PDL=0 timeout 100 python3 benchmarks/profile_moe.py --tokens 32,64 > "$OUT/s9a_prof.log" 2>&1
           grep -v "^jitmarlin" "$OUT/s9a_prof.log" | grep -v Warn | head -40;;
    s9b)   # session 9: the MoE bench of the README table (the direct-load tile for MoE blocks of 8
           # rows was timed here too, measured no better, and removed: NOTES.md session 9)
           timeout 300 python3 benchmarks/bench_moe.py --tokens ${MOE_TOKENS:-1,16,32,64,128,256,1024} --json "$OUT/s9b_moe.json" \
             > "$OUT/s9b_moe.log" 2>&1; echo "moe rc=$?"; grep -E "^\| (mixtral|e64)" "$OUT/s9b_moe.log";;
    s9c)   # session 9: deeper cp.async rings for the wgmma kernel (it kept 3 stages x 8 KB of weights in
           # flight per SM at 64-token tiles): dense M = 64 / 128 / 256, then the MoE blocks of 64 / 128
           timeout 240 python3 benchmarks/probe_configs.py --shapes ${S9C_SHAPES:-4096x28672,8192x28672,28672x8192,8192x8192} \
             --m 64 --extra-wgmma 64-2-8,64-2-12,64-1-8 \
             --configs wgmma-n64-f2-s4,wgmma-n64-f2-s8,wgmma-n64-f2-s12,wgmma-n64-f1-s6,wgmma-n64-f1-s8 \
             2>&1 | grep -v "^done" | tee "$OUT/s9c_m64.log"
           timeout 240 python3 benchmarks/probe_configs.py --shapes ${S9C_SHAPES:-4096x28672,8192x28672,28672x8192,8192x8192} \
             --m 128,256 --extra-wgmma 128-2-4,128-2-8,128-1-5 \
             --configs wgmma-n128-f2-s4,wgmma-n128-f2-s8,wgmma-n128-f1-s4,wgmma-n128-f1-s5 \
             2>&1 | grep -v "^done" | tee "$OUT/s9c_m128.log"
           for w in "" 64-2-8 64-2-12 64-1-8,64-2-8 128-1-5 128-1-8; do
             timeout 150 python3 benchmarks/probe_moe_tiles.py --tokens 64,128,256,1024 ${w:+--wgmma $w} 2>&1 | grep "^\[" \
               | tee -a "$OUT/s9c_moe.log"
           done;;
    s9d)   # session 9: direct-load tiles for 8-bit weights at M <= 8 (one tile ahead at k128, or k64
           # tiles one / two ahead: 120-151 registers, no spills) vs the rings they take now
           timeout 200 python3 benchmarks/probe_configs.py --bits 8 --any-fit \
             --shapes 4096x4096,4096x28672,14336x4096,8192x8192,8192x28672,28672x8192 --m 1,8 \
             --extra-tiles w8_k128_s6_bk_dr1,w8_k64_s8_bk_dr2,w8_k64_s8_bk_dr1 \
             --configs w8_k128_s6_bk-w4,w8_k128_s6_bk_ks2-w4,w8_k128_s6_bk_dr1-w4,w8_k64_s8_bk_dr2-w4,w8_k64_s8_bk_dr1-w4 \
             2>&1 | grep -v "^done" | tee "$OUT/s9d_u8.log";;
    s9e)   # session 9: 4-bit direct-load one tile ahead (vs two, the route) at M <= 8, and direct-load
           # 16-row tiles for 8-bit weights at M = 9-16 (vs the five-slot ring, the route)
           timeout 150 python3 benchmarks/probe_configs.py --any-fit --shapes 4096x28672,8192x8192,8192x28672,28672x8192 \
             --m 1,8 --extra-tiles w8_k128_s6_bk_dr1 --configs w8_k128_s6_bk_dr2-w4,w8_k128_s6_bk_dr1-w4 \
             2>&1 | grep -v "^done" | tee "$OUT/s9e_u4.log"
           timeout 150 python3 benchmarks/probe_configs.py --bits 8 --any-fit \
             --shapes 4096x28672,14336x4096,8192x8192,8192x28672,28672x8192 --m 9,16 \
             --extra-tiles w16_k128_s6_bk_dr1,w16_k64_s8_bk_dr1 \
             --configs w16_k128_s5_bk-w4,w16_k128_s6_bk_dr1-w4,w16_k64_s8_bk_dr1-w4 2>&1 | grep -v "^done" | tee "$OUT/s9e_u8.log";;
    s10a)  # session 10 (prepared in session 9, branch prep-session10): three CTAs per SM.
           # (1) MoE blocks of 8 on the direct-load tile (one / two ahead, three CTAs per SM at 128
           # registers) vs the ring, alternating; (2) 16-row tiles with 3 CTAs/SM (4-bit: 3 ring
           # slots of k128 or 6 of k64, 125-128 registers) at dense M = 9 / 16 and MoE blocks of 16;
           # (3) 8-bit M=16 rings that fit two CTAs per SM (the five-slot ring fits one)
           P="timeout 120 python3 benchmarks/probe_moe_tiles.py"
           for r in 1 2; do
             for t in "" w8_k128_s6_bk_dr1_o3 w8_k128_s6_bk_dr1 w8_k128_s6_bk_dr2; do
               $P --tokens 1,16 ${t:+--tile $t} 2>&1 | grep "^\[" | tee -a "$OUT/s10a_moe8.log"
             done
           done
           for t in "" w16_k128_s3_bk_o3 w16_k64_s6_bk_o3; do
             $P --tokens 32 ${t:+--tile $t} 2>&1 | grep "^\[" | tee -a "$OUT/s10a_moe16.log"
           done
           timeout 200 python3 benchmarks/probe_configs.py --shapes 4096x4096,4096x28672,14336x4096,8192x8192,8192x28672,28672x8192 \
             --m 9,16 --any-fit --extra-tiles w16_k128_s3_bk_o3,w16_k64_s6_bk_o3 \
             --configs w16_k128_s5_bk-w4,w16_k128_s3_bk_o3-w4,w16_k64_s6_bk_o3-w4,m1_k128_s6-w4 \
             2>&1 | grep -v "^done" | tee "$OUT/s10a_m16.log"
           timeout 200 python3 benchmarks/probe_configs.py --bits 8 --shapes 4096x28672,14336x4096,8192x8192,8192x28672,28672x8192 \
             --m 16 --any-fit --extra-tiles w16_k64_s6_bk,w16_k64_s4_bk_o3,w16_k128_s3_bk \
             --configs w16_k128_s5_bk-w4,w16_k64_s6_bk-w4,w16_k64_s4_bk_o3-w4,w16_k128_s3_bk-w4 \
             2>&1 | grep -v "^done" | tee "$OUT/s10a_u8m16.log";;
    s10b)  # session 10: the three-CTAs-per-SM MoE routes (now built in) against the routes before
           # (--no-occ), alternating; then larger expert blocks on such tiles where the rule takes
           # the wgmma kernel's blocks of 64 (Mixtral 48 / 64 tokens, E=64 256 tokens)
           P="timeout 150 python3 benchmarks/probe_moe_tiles.py"
           for r in 1 2; do
             for o in "" --no-occ; do $P --tokens 1,3,16,32,64,128 $o 2>&1 | grep "^\[" | tee -a "$OUT/s10b_occ.log"; done
           done
           $P --tokens 32 --tile w16_k128_s4_bk_o3 2>&1 | grep "^\[" | tee -a "$OUT/s10b_big.log"
           $P --tokens 48,64 --shapes mixtral 2>&1 | grep "^\[" | tee -a "$OUT/s10b_big.log"
           $P --tokens 48,64 --shapes mixtral --block 16 2>&1 | grep "^\[" | tee -a "$OUT/s10b_big.log"
           for t in "" m2_k64_s4_bk_o3 m2_k128_s3_bk_o2; do
             $P --tokens 48,64 --shapes mixtral --block 32 ${t:+--tile $t} 2>&1 | grep "^\[" | tee -a "$OUT/s10b_big.log"
             $P --tokens 256 --shapes e64 --block 32 ${t:+--tile $t} 2>&1 | grep "^\[" | tee -a "$OUT/s10b_big.log"
           done
           $P --tokens 256 --shapes e64 2>&1 | grep "^\[" | tee -a "$OUT/s10b_big.log";;
    s10c)  # session 10: the MoE table on the new routes; ring tiles with three CTAs per SM (3 slots
           # of k128 / 6 of k64: the 6-slot ring fits one CTA) for MoE blocks of 8 below the
           # direct-load rule (E=64, 1 token) and dense 4096^2 M=1; the 4-bit 16-row direct-load
           # tile at M = 9 / 16 on the mid-size shapes (session 7: 5% faster there)
           timeout 200 python3 benchmarks/bench_moe.py --tokens 1,16,32,64,128,256,1024 --json "$OUT/moe.json" \
             > "$OUT/moe.log" 2>&1; echo "moe rc=$?"; tail -24 "$OUT/moe.log"
           P="timeout 100 python3 benchmarks/probe_moe_tiles.py --shapes e64 --tokens 1,3"
           for t in "" w8_k128_s3_bk_o3 w8_k64_s6_bk_o3; do $P ${t:+--tile $t} 2>&1 | grep "^\[" | tee -a "$OUT/s10c_moe.log"; done
           timeout 150 python3 benchmarks/probe_configs.py --shapes 4096x4096,4096x11008,11008x4096 --m 1,8 --any-fit \
             --extra-tiles w8_k128_s3_bk_o3,w8_k64_s6_bk_o3 \
             --configs w8_k128_s6_bk_ks2-w4,w8_k128_s3_bk_o3-w4,w8_k64_s6_bk_o3-w4,w8_k128_s3_bk_o3-w2 \
             2>&1 | grep -v "^done" | tee "$OUT/s10c_m1.log"
           timeout 150 python3 benchmarks/probe_configs.py --shapes 8192x8192,14336x4096,4096x28672,4096x11008 --m 9,16 \
             --extra-tiles w16_k128_s6_bk_dr1 --configs w16_k128_s5_bk-w4,m1_k128_s6-w4,w16_k128_s6_bk_dr1-w4 \
             2>&1 | grep -v "^done" | tee "$OUT/s10c_m16.log";;
    s10d)  # session 10: a second wave of CTAs (grid 2x / 3x what fits at once: the block scheduler
           # then balances the tail that the static split leaves, NOTES.md session 8) at M = 1 / 16;
           # 8-bit M = 9-16 on the mid-size shapes: the ring vs the cp.async tile
           timeout 150 python3 benchmarks/probe_configs.py --shapes 8192x28672,28672x8192,4096x28672 --m 1 \
             --configs w8_k128_s6_bk_dr1-w4,w8_k128_s6_bk_dr1-w4-g792,w8_k128_s6_bk_dr1-w4-g1188 \
             2>&1 | grep -v "^done" | tee "$OUT/s10d_wave.log"
           timeout 100 python3 benchmarks/probe_configs.py --shapes 8192x8192 --m 1 \
             --configs w8_k128_s6_bk_dr2-w4,w8_k128_s6_bk_dr2-w4-g528,w8_k128_s6_bk_dr2-w4-g792 \
             2>&1 | grep -v "^done" | tee -a "$OUT/s10d_wave.log"
           timeout 100 python3 benchmarks/probe_configs.py --shapes 8192x28672,8192x8192 --m 16 \
             --configs w16_k128_s5_bk-w4,w16_k128_s5_bk-w4-g528,w16_k128_s5_bk-w4-g792 \
             2>&1 | grep -v "^done" | tee -a "$OUT/s10d_wave.log"
           timeout 100 python3 benchmarks/probe_configs.py --bits 8 --shapes 14336x4096,4096x11008,11008x4096 --m 9,16 \
             --configs w16_k128_s5_bk-w4,m1_k128_s6-w4 2>&1 | grep -v "^done" | tee "$OUT/s10d_u8.log";;
    timeline) # prepared in session 10 (branch prep-session11): where a call's fixed cost goes in a
           # chain of GEMMs (per-CTA GPU timestamps, kernels built with -DJM_TIMELINE)
           timeout 240 python3 benchmarks/probe_timeline.py \
             --shapes ${TL_SHAPES:-8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x4096} --m ${TL_M:-1,8,16} \
             2>&1 | grep -v "^jitmarlin:" | tee "$OUT/timeline.log";;
    flagab) # the GEMM table (6 shapes, M = 1 / 16, no peers) built with each of FLAGAB_FLAGS (words;
           # "" = the default build first): kernel experiments behind macros, A/B in one run
           S6=4096x4096,4096x28672,14336x4096,8192x8192,8192x28672,28672x8192
           for f in "" ${FLAGAB_FLAGS:--DJM_NO_FIXUP}; do
             tag=$(echo "$f" | tr -c 'A-Za-z0-9_\n' _)
             JITMARLIN_NVCC_FLAGS="$f" timeout 150 python3 benchmarks/bench_gemm.py --variants none --peers none \
               --shapes ${FLAGAB_SHAPES:-$S6} --m ${FLAGAB_M:-1,16} --json "$OUT/flagab$tag.json" > "$OUT/flagab$tag.log" 2>&1
             echo "== flagab [$f] rc=$?"; grep -E "^\| [0-9]" "$OUT/flagab$tag.log"
           done;;
    cluster) # session 11: cluster launches (units split along K inside 8-CTA clusters, DSMEM sums) vs
           # the striped launch (JITMARLIN_CLUSTER=0), same run
           S6=4096x4096,4096x28672,14336x4096,8192x8192,8192x28672,28672x8192
           for env in "JITMARLIN_CLUSTER=1" "JITMARLIN_CLUSTER=0"; do
             env $env timeout 150 python3 benchmarks/bench_gemm.py --variants none --peers none \
               --shapes ${CL_SHAPES:-$S6} --m ${CL_M:-1,16} --json "$OUT/cluster_$env.json" > "$OUT/cluster_$env.log" 2>&1
             echo "== cluster [$env] rc=$?"; grep -E "^\| [0-9]" "$OUT/cluster_$env.log"
           done;;
    s12a)  # prepared in session 11 (not yet run): cluster forms that fill the GPU on 8192^2 / 4096x11008
           # (clusters of 4 at 2 warps, the k-split ring at three stages = three CTAs per SM) and the
           # same with CTAs kept at most 2 per SM (--max-per-sm 2: cluster CTAs spread over the SMs)
           S=4096x4096,8192x8192,14336x4096,4096x11008
           E=w8_k128_s6_bk_dr2_cl4,w8_k128_s6_bk_dr2_cl8,w16_k128_s6_bk_dr1_cl4,w16_k128_s6_bk_dr1_cl8,w8_k128_s3_bk_ks2_cl8
           for pad in 0 2; do
             timeout 200 python3 benchmarks/probe_configs.py --shapes $S --m 1 --max-per-sm $pad --extra-tiles $E \
               --configs w8_k128_s6_bk_dr2-w4,w8_k128_s6_bk_ks2_cl8-w2,w8_k128_s6_bk_dr2_cl8-w2,w8_k128_s6_bk_dr2_cl4-w2,w8_k128_s3_bk_ks2_cl8-w4 \
               2>&1 | grep -v "^done\|^jitmarlin:" | sed "s/^/[pad $pad] /" | tee -a "$OUT/s12a.log"
             timeout 150 python3 benchmarks/probe_configs.py --shapes $S --m 16 --max-per-sm $pad --extra-tiles $E \
               --configs w16_k128_s6_bk_dr1-w4,w16_k128_s6_bk_dr1_cl8-w2,w16_k128_s6_bk_dr1_cl4-w2 \
               2>&1 | grep -v "^done\|^jitmarlin:" | sed "s/^/[pad $pad] /" | tee -a "$OUT/s12a.log"
           done;;
    s12d)  # session 12: the act-order gather's link in the launch chain at M = 1 / 8 / 16 (gather launched
           # as a programmatic dependent by the route's rule, never, always), and bf16 vs f16 on the
           # cluster route (14336x4096 M=1: bf16 1.14x f16 in session 11)
           for g in route 0 1; do
             timeout 150 python3 benchmarks/probe_act_order.py --shapes ${AO_SHAPES:-8192x28672,28672x8192,8192x8192,4096x28672} \
               --m 1,8,16 --gather-pdl $g 2>&1 | grep "^\[" | tee -a "$OUT/s12d.log"
           done
           for dt in f16 bf16; do
             timeout 120 python3 benchmarks/probe_configs.py --shapes 14336x4096,4096x4096 --m 1 --dtype $dt \
               --configs w8_k128_s6_bk_ks2_cl8-w2,w8_k128_s6_bk_ks2-w4,w8_k128_s6_bk_dr2-w4,w8_k128_s6_bk_dr1-w4,w8_k128_s6_bk-w4 \
               2>&1 | grep -v "^done\|^jitmarlin:" | sed "s/^/[$dt] /" | tee -a "$OUT/s12d.log"
           done;;
    s12e)  # session 12: bf16 keeps the striped launch past 8 k tiles per cluster CTA (gemm.choose_cluster);
           # 8-bit weights at M=16 (1.56-1.67x fp16 in session 11): the 16-row tiles, more warps, 8-row passes
           timeout 150 python3 benchmarks/bench_gemm.py --variants bf16 --variant-m 1,8,16 --peers none \
             --shapes 14336x4096,4096x4096 --m 1,8,16 --json "$OUT/s12e_bf16.json" > "$OUT/s12e_bf16.log" 2>&1
           echo "== bf16 rc=$?"; grep -E "^\| [0-9]" "$OUT/s12e_bf16.log"
           timeout 200 python3 benchmarks/probe_configs.py --bits 8 --m 16 --shapes 8192x28672,4096x28672,8192x8192 \
             --any-fit --extra-tiles w16_k128_s6_bk_dr1 \
             --configs w16_k128_s5_bk-w4,w16_k128_s4_bk-w4,w16_k128_s4_bk-w8,w16_k128_s6_bk-w4,w16_k128_s6_bk_dr1-w4,w8_k128_s6_bk_dr1-w4,m1_k128_s4_bk-w4 \
             2>&1 | grep -v "^done\|^jitmarlin:" | tee -a "$OUT/s12e.log";;
    s12f)  # session 12: the formats table (bf16 / 8-bit / act-order vs f16 x int4, M = 1 / 16) after the
           # bf16 cluster rule and the 8-bit six-slot 16-row ring
           timeout 300 python3 benchmarks/bench_gemm.py --variants bf16,u8,act_order --variant-m 1,16 --peers none \
             --m 1,16 --json "$OUT/s12f.json" > "$OUT/s12f.log" 2>&1
           echo "== s12f rc=$?"; grep -E "^\| [0-9]|÷|×" "$OUT/s12f.log" | tail -30;;
    s13a)  # prepared in session 12 (not yet run): M=16 on the narrow-N shapes, where a unit of 256 columns
           # is split 4-8 ways and the fixup costs ~6 us (4-bit no-fixup bound 14336x4096 20.1 -> 14.3):
           # 128-column CTAs (2 warps) halve each partial sum (8 KB) and fit two or three per SM; 8-bit, 4-bit
           for b in 8 4; do
             timeout 200 python3 benchmarks/probe_configs.py --bits $b --m 16 --shapes 14336x4096,4096x28672,8192x8192 --any-fit --extra-tiles w16_k128_s6_bk_dr1 \
               --configs w16_k128_s6_bk-w4,w16_k128_s5_bk-w4,w16_k128_s6_bk-w2,w16_k128_s5_bk-w2,w16_k128_s4_bk-w2,w16_k128_s6_bk_dr1-w4,w16_k128_s6_bk_dr1-w2 \
               2>&1 | grep -v "^done\|^jitmarlin:" | sed "s/^/[u$b] /" | tee -a "$OUT/s13a.log"
           done;;
    s13b)  # prepared in session 12 (branch prep-moe-gather, not yet run): act-order experts gathered by
           # jm_moe_gather instead of torch indexing through an [L, K] int64 index; GPU tests of the MoE
           # path first, then the act-order times (kernel gather vs torch gather, same run)
           timeout 300 python3 -m pytest -q -rs tests/gpu/test_moe_util_gpu.py tests/gpu/test_moe_gpu.py \
             tests/gpu/test_checkpoint_gpu.py > "$OUT/s13b_tests.log" 2>&1
           echo "== s13b tests rc=$?"; tail -3 "$OUT/s13b_tests.log"
           timeout 240 python3 benchmarks/bench_moe.py --act-order --tokens 1,16,64,256,1024 --json "$OUT/s13b.json" \
             > "$OUT/s13b.log" 2>&1
           echo "== s13b bench rc=$?"; grep -E "act-order|^\| " "$OUT/s13b.log" | head -40;;
    s13c)  # wgmma token tiles of 16 and 32 (m64n16k16 / m64n32k16: no padding to 64 tokens) against the routes,
           # dense M = 9-32 (4- and 8-bit) and MoE expert blocks of 16 / 32 rows
           W="--extra-wgmma 32-1-8,32-2-8,16-1-8,16-2-8"
           timeout 240 python3 benchmarks/probe_configs.py $W --m 17,24,32 \
             --shapes 8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x4096 \
             --configs route,wgmma-n32-f1-s8,wgmma-n32-f2-s8,wgmma-n64-f1-s6 2>&1 | grep -v "^done\|^jitmarlin:" | tee -a "$OUT/s13c.log"
           timeout 200 python3 benchmarks/probe_configs.py $W --m 9,16 \
             --shapes 8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x4096 \
             --configs route,wgmma-n16-f1-s8,wgmma-n16-f2-s8,wgmma-n32-f1-s8 2>&1 | grep -v "^done\|^jitmarlin:" | tee -a "$OUT/s13c.log"
           timeout 200 python3 benchmarks/probe_configs.py $W --bits 8 --m 16,32 \
             --shapes 8192x28672,28672x8192,4096x28672,8192x8192 \
             --configs route,w16_k128_s6_bk-w2,w16_k128_s5_bk-w4,wgmma-n16-f1-s8,wgmma-n32-f1-s8,wgmma-n32-f2-s8 2>&1 \
             | grep -v "^done\|^jitmarlin:" | tee -a "$OUT/s13c.log"
           timeout 100 python3 benchmarks/probe_moe_tiles.py --tokens 16,32,64,128 2>&1 | grep -v "^jitmarlin:" | tee -a "$OUT/s13c.log"
           for bl in 16 32; do
             timeout 120 python3 benchmarks/probe_moe_tiles.py --tokens 16,32,64,128 --block $bl --wgmma $bl-1-8,$bl-2-8 2>&1 \
               | grep -v "^jitmarlin:" | tee -a "$OUT/s13c.log"
           done;;
    s13d)  # after the 16/32-token wgmma routes: their GPU tests; MoE blocks of 16 / 32 on the wgmma kernel at
           # 9-24 rows per expert (Mixtral 48-96 tokens, E=64 96-192 tokens) against the current rule
           timeout 300 python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py tests/gpu/test_formats_gpu.py \
             > "$OUT/s13d_tests.log" 2>&1
           echo "== s13d tests rc=$?"; tail -5 "$OUT/s13d_tests.log"
           for a in "" "--block 16 --wgmma 16-1-8,16-2-8" "--block 32 --wgmma 32-1-8,32-2-8"; do
             timeout 100 python3 benchmarks/probe_moe_tiles.py --shapes mixtral --tokens 40,48,64,80,96 $a 2>&1 | grep -v "^jitmarlin:" | tee -a "$OUT/s13d.log"
             timeout 100 python3 benchmarks/probe_moe_tiles.py --shapes e64 --tokens 96,128,160,192,256 $a 2>&1 | grep -v "^jitmarlin:" | tee -a "$OUT/s13d.log"
           done;;
    s13e)  # act-order on the 16/32-token wgmma routes (bench: 4096^2 M=16 1.41x plain, M=32 1.55-1.62x): the
           # wgmma kernel's weight copies before griddep_wait (default) vs waiting first (-DJM_WG_WAIT_FIRST),
           # and the mma.sync routes (JITMARLIN_WGMMA=0); then the wgmma GPU tests on the default build
           for f in "" "-DJM_WG_WAIT_FIRST"; do
             JITMARLIN_NVCC_FLAGS="$f" timeout 150 python3 benchmarks/probe_act_order.py \
               --shapes 4096x4096,4096x28672,8192x8192,14336x4096 --m 16,32,64 2>&1 | grep -v "^jitmarlin:" | tee -a "$OUT/s13e.log"
           done
           [ -n "${S13E_PROBES_ONLY:-}" ] && continue
           JITMARLIN_WGMMA=0 timeout 150 python3 benchmarks/probe_act_order.py \
             --shapes 4096x4096,4096x28672,8192x8192,14336x4096 --m 16,32,64 2>&1 | grep -v "^jitmarlin:" | tee -a "$OUT/s13e.log"
           timeout 200 python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py > "$OUT/s13e_tests.log" 2>&1
           echo "== s13e tests rc=$?"; tail -3 "$OUT/s13e_tests.log";;
    s13f)  # final check of session 13: act-order layers (the wgmma kernel as a plain launch after the gather),
           # then the formats table at M = 1 / 16 / 32 / 64 (run after "tests")
           timeout 120 python3 benchmarks/probe_act_order.py --shapes 4096x4096,4096x28672,8192x8192,14336x4096 \
             --m 16,32,64 2>&1 | grep -v "^jitmarlin:" | tee -a "$OUT/s13f.log"
           timeout 240 python3 benchmarks/bench_gemm.py --variants bf16,u8,act_order --variant-m 1,16,32,64 --peers none \
             --m 1,16,32,64 --json "$OUT/s13f.json" > "$OUT/s13f_formats.log" 2>&1
           echo "== s13f formats rc=$?"; grep -E "^\| [0-9]" "$OUT/s13f_formats.log" | tail -24;;
    s14a)  # prepared in session 13 (branch prep-wgmma-preload, on exp-wgmma-nacc; NOT yet run): the wgmma
           # kernel with two accumulator sets for 16/32-token tiles and the stage's weight words read from
           # shared memory at once. Run "tests" first (whole suite), then this A/B (same run):
           # default / -DJM_WG_NO_PRELOAD / -DJM_WG_NACC=1 -DJM_WG_NO_PRELOAD (= main's kernel)
           SH="8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x4096"
           for f in "" "-DJM_WG_NO_PRELOAD" "-DJM_WG_NACC=1 -DJM_WG_NO_PRELOAD"; do
             JITMARLIN_NVCC_FLAGS="$f" timeout 150 python3 benchmarks/probe_configs.py --m 16,32,64,256 --shapes $SH \
               --configs route 2>&1 | grep -v "^done\|^jitmarlin:" | tee -a "$OUT/s14a.log"
             JITMARLIN_NVCC_FLAGS="$f" timeout 100 python3 benchmarks/probe_moe_tiles.py --tokens 16,64,256,1024 2>&1 \
               | grep -v "^jitmarlin:" | sed "s/^/[$f] /" | tee -a "$OUT/s14a.log"
           done
           # where a wgmma call's time goes (per-CTA timeline, -DJM_TIMELINE build: entry, past the wait, first
           # stage, last stage, end), M = 16 / 32 / 64 on the routes
           timeout 120 python3 benchmarks/probe_timeline.py --shapes 8192x28672,8192x8192,4096x4096 --m 16,32,64 2>&1 \
             | grep -v "^jitmarlin:" | tee -a "$OUT/s14a.log";;
    s14p)  # Nsight Compute on the wgmma kernel (stall cycles per issued instruction by reason, issue rate,
           # instruction mix): 8192x28672 at M = 64 (route) and M = 32 (JITMARLIN_WGMMA=1: the n32 tile)
           for m in ${S14P_M:-64 32}; do
             JITMARLIN_WGMMA=1 timeout 120 ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
               --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis \
               --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -k regex:jm_wgmma -s 2 -c 1 \
               python3 benchmarks/profile_gemm.py --k 8192 --n 28672 --m $m > "$OUT/s14p_$m.txt" 2>&1
             echo "s14p M=$m rc=$?"; grep -E "jm_wgmma|Duration|Throughput|Registers|Issued Ipc|Issue Slots|No Eligible|Active Warps|Eligible Warps" "$OUT/s14p_$m.txt" | head -24
             grep -E "issue_stalled" "$OUT/s14p_$m.txt" | sort -k3 -g -r | head -10
           done;;
    s14b)  # what the wgmma kernel's per-stage proxy fence costs (-DJM_WG_NO_PROXY_FENCE: diagnostic, formally racy)
           SH="8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x4096"
           for f in "" "-DJM_WG_NO_PROXY_FENCE"; do
             JITMARLIN_NVCC_FLAGS="$f" JITMARLIN_WGMMA=1 timeout 150 python3 benchmarks/probe_configs.py --m 16,32,64,256 --shapes $SH \
               --configs route 2>&1 | grep -v "^done\|^jitmarlin:" | sed "s/^/[$f] /" | tee -a "$OUT/s14b.log"
             JITMARLIN_NVCC_FLAGS="$f" timeout 100 python3 benchmarks/probe_moe_tiles.py --tokens 64,256,1024 2>&1 \
               | grep -v "^jitmarlin:" | sed "s/^/[$f] /" | tee -a "$OUT/s14b.log"
           done
           JITMARLIN_NVCC_FLAGS="-DJM_WG_NO_PROXY_FENCE" timeout 120 python3 -m pytest -q -x tests/gpu/test_wgmma_gpu.py \
             -k "formats or k_splits or blocks_of" > "$OUT/s14b_tests.log" 2>&1
           echo "== s14b tests (no proxy fence) rc=$?"; tail -2 "$OUT/s14b_tests.log";;
    s14c)  # per-instruction stall sampling of the wgmma kernel (ncu source page, SASS), 8192x28672 M=64 and
           # 14336x4096 M=32; then K splits for the 32-token tile on the two narrow shapes
           for spec in ${S14C_SPECS:-8192,28672,64 14336,4096,32}; do
             IFS=, read -r k n m <<< "$spec"
             JITMARLIN_WGMMA=1 timeout 150 ncu --clock-control none --section WarpStateStats --section SourceCounters \
               --import-source no -k regex:jm_wgmma -s 2 -c 1 -o "$OUT/s14c_${k}_${n}_${m}" -f \
               python3 benchmarks/profile_gemm.py --k $k --n $n --m $m > "$OUT/s14c_${k}_${n}_${m}.log" 2>&1
             echo "s14c $spec rc=$?"
             timeout 60 ncu -i "$OUT/s14c_${k}_${n}_${m}.ncu-rep" --page source --csv --print-source sass \
               > "$OUT/s14c_${k}_${n}_${m}_sass.csv" 2>&1; echo "source page rc=$? $(wc -l < "$OUT/s14c_${k}_${n}_${m}_sass.csv") lines"
           done
           timeout 120 python3 benchmarks/probe_configs.py --m 32 --shapes 14336x4096,4096x4096 \
             --configs route,wgmma-n32-f1-s8-k4,wgmma-n32-f1-s8-k8,wgmma-n32-f1-s8-k2,wgmma-n32-f2-s8-k8 2>&1 \
             | grep -v "^done\|^jitmarlin:" | tee -a "$OUT/s14c.log";;
    s14d)  # the split copy roles (default: the first warpgroup copies and fences the activations, the second
           # the weights) vs every thread on both (-DJM_WG_COPY_ALL) vs no fence (diagnostic), same run; wgmma tests
           timeout 150 python3 -m pytest -q -x tests/gpu/test_wgmma_gpu.py > "$OUT/s14d_tests.log" 2>&1
           echo "== s14d wgmma tests rc=$?"; tail -2 "$OUT/s14d_tests.log"
           SH="8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x4096"
           for f in "" "-DJM_WG_COPY_ALL" "-DJM_WG_NO_PROXY_FENCE -DJM_WG_COPY_ALL"; do
             JITMARLIN_NVCC_FLAGS="$f" JITMARLIN_WGMMA=1 timeout 150 python3 benchmarks/probe_configs.py --m 16,32,64,256 --shapes $SH \
               --configs route 2>&1 | grep -v "^done\|^jitmarlin:" | sed "s/^/[$f] /" | tee -a "$OUT/s14d.log"
             JITMARLIN_NVCC_FLAGS="$f" timeout 100 python3 benchmarks/probe_moe_tiles.py --tokens 16,64,256,1024 2>&1 \
               | grep -v "^jitmarlin:" | sed "s/^/[$f] /" | tee -a "$OUT/s14d.log"
           done;;
    s14e)  # stream-K for the wgmma kernel (tiles cut evenly over the resident CTAs): GPU tests, then the
           # 28672-wide shapes (112 two-strip tiles on 132 SMs) with and without it, same run
           timeout 200 python3 -m pytest -q -x tests/gpu/test_wgmma_gpu.py > "$OUT/s14e_tests.log" 2>&1
           echo "== s14e wgmma tests rc=$?"; tail -3 "$OUT/s14e_tests.log"
           timeout 240 python3 benchmarks/probe_configs.py --settle 0.3 --m 17,32,48,64 --shapes 8192x28672,4096x28672,4096x22016 \
             --configs route,wgmma-n32-f2-s8-k1,wgmma-n32-f2-s8-sk,wgmma-n64-f2-s4-k1,wgmma-n64-f2-s4-sk,wgmma-n64-f1-s6-sk,wgmma-n32-f1-s8-sk \
             2>&1 | grep -v "^done\|^jitmarlin:" | tee -a "$OUT/s14e.log";;
    s15b)  # the act-order gather staged through shared memory (one row per CTA, ~64 CTAs: a programmatic
           # dependent) from M = 4 against the scattered kernel (one row per thread), and at M = 1 too
           timeout 200 python3 -m pytest -q -rs tests/gpu -k "gather or act_order or perm" > "$OUT/s15b_tests.log" 2>&1
           echo "== s15b tests rc=$?"; tail -3 "$OUT/s15b_tests.log"
           SH=4096x4096,14336x4096,8192x8192,4096x28672,28672x8192,8192x28672
           for a in "" "--gather-smem-min-m 100000" "--gather-smem-min-m 1"; do
             timeout 150 python3 benchmarks/probe_act_order.py --shapes $SH --m 1,4,8,16,32 $a 2>&1 | grep -v "^jitmarlin:" | tee -a "$OUT/s15b.log"
           done
           timeout 100 python3 benchmarks/probe_act_order.py --shapes 4096x4096,14336x4096,8192x8192,4096x28672 --m 16,32,64 \
             --wgmma-pdl 1 2>&1 | grep -v "^jitmarlin:" | tee -a "$OUT/s15b.log"
           timeout 100 python3 benchmarks/probe_act_order.py --shapes 4096x4096,14336x4096,8192x8192,4096x28672 --m 64 \
             2>&1 | grep -v "^jitmarlin:" | tee -a "$OUT/s15b.log"
           timeout 200 python3 benchmarks/bench_gemm.py --variants act_order --variant-m 1,16,32 --peers none \
             --m 1,16,32 --json "$OUT/s15b.json" > "$OUT/s15b_formats.log" 2>&1
           echo "== s15b formats rc=$?"; grep -E "^\| [0-9]" "$OUT/s15b_formats.log" | tail -20;;
    s15d)  # the formats table (bf16, 8-bit, act-order at M = 1 / 16 / 32 / 64; run after "tests")
           timeout 240 python3 benchmarks/bench_gemm.py --variants bf16,u8,act_order --variant-m 1,16,32,64 --peers none \
             --m 1,16,32,64 --json "$OUT/s15d.json" > "$OUT/s15d_formats.log" 2>&1
           echo "== s15d formats rc=$?"; grep -E "^\| [0-9]" "$OUT/s15d_formats.log" | tail -24;;
    s15e)  # dense activations of the wgmma kernel by TMA (no per-stage proxy fence) against cp.async
           # (-DJM_WG_NO_TMA), same run, the wgmma routes (run after "tests")
           for f in "" "-DJM_WG_NO_TMA"; do
             JITMARLIN_NVCC_FLAGS="$f" timeout 150 python3 benchmarks/probe_configs.py --settle 0.3 --m 17,32,64,128,256 \
               --shapes 8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x4096 --configs route 2>&1 \
               | grep -v "^done\|^jitmarlin:" | tee -a "$OUT/s15e.log"
           done;;
    s16c)  # the 128-token tile's ring depth (5 / 3 stages vs 4) and 64-token tiles with one strip vs the
           # route, after the session-16 route (wgmma to M = 1024, 128-token tiles with one strip)
           timeout 200 python3 benchmarks/probe_configs.py --settle 0.2 --m 64 --extra-wgmma 128-1-5,128-1-3 \
             --shapes 8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x4096 \
             --configs route,wgmma-n64-f1-s6,wgmma-n64-f2-s4,wgmma-n128-f1-s4 2>&1 | grep -v "^done\|^jitmarlin:" | tee -a "$OUT/s16c.log"
           timeout 200 python3 benchmarks/probe_configs.py --settle 0.2 --m 128,256,1024 --extra-wgmma 128-1-5,128-1-3 \
             --shapes 8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x4096 \
             --configs route,wgmma-n128-f1-s5,wgmma-n128-f1-s3 2>&1 | grep -v "^done\|^jitmarlin:" | tee -a "$OUT/s16c.log";;
    s17a)  # prepared in session 16 (branch prep-wgmma-wide, NOT run): the wide form of two-strip CTAs
           # (four warpgroups of one strip, 512 threads: 16 warps per SM sharing one activation tile, no
           # cluster) against the route (128-token tiles: two one-strip CTAs per SM), same run
           timeout 240 python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py -k "wide_form" > "$OUT/s17a_tests.log" 2>&1
           echo "== s17a tests rc=$?"; tail -3 "$OUT/s17a_tests.log"
           S6=8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x4096
           timeout 150 python3 benchmarks/probe_configs.py --settle 0.2 --m 33,64 --extra-wgmma 64-2-4-w,64-2-8-w \
             --shapes $S6 --configs route,wgmma-n64-f2-s4,wgmma-n64-f2-s4-w,wgmma-n64-f2-s8-w 2>&1 | grep -v "^done\|^jitmarlin:" \
             | tee -a "$OUT/s17a.log"
           timeout 240 python3 benchmarks/probe_configs.py --settle 0.2 --m 128,256,1024 --extra-wgmma 128-2-4,128-2-4-w,128-2-6-w \
             --shapes $S6 --configs route,wgmma-n128-f2-s4,wgmma-n128-f2-s4-w,wgmma-n128-f2-s6-w 2>&1 | grep -v "^done\|^jitmarlin:" \
             | tee -a "$OUT/s17a.log"
           # the B descriptor once per stage (default on the branch) vs per k16 step, the routes
           for f in "" "-DJM_WG_DESC_PER_STEP"; do
             JITMARLIN_NVCC_FLAGS="$f" timeout 150 python3 benchmarks/probe_configs.py --settle 0.2 --m 32,64,256,1024 \
               --shapes $S6 --configs route 2>&1 | grep -v "^done\|^jitmarlin:" | tee -a "$OUT/s17a.log"
           done;;
    s17b)  # MoE blocks of 32 / 64 rows with one or two strips per warpgroup (dense 128-token tiles gained
           # 5-43% from one strip in session 16), and the dense M=1 -> M=16 delta split by diagnostic
           # builds (fixup protocol skipped; weights streamed, nothing computed)
           for fw in "" 1 2; do
             timeout 120 python3 benchmarks/probe_moe_tiles.py --tokens 16,32,64,128,256 ${fw:+--fw $fw} 2>&1 \
               | grep -v "^jitmarlin:" | sed "s/^/[fw=${fw:-rule}] /" | tee -a "$OUT/s17b.log"
           done
           for f in "" -DJM_NO_FIXUP -DJM_STREAM_ONLY; do
             JITMARLIN_NVCC_FLAGS="$f" timeout 120 python3 benchmarks/probe_configs.py --settle 0.2 --m 1,8,9,16 \
               --shapes 8192x8192,4096x28672,14336x4096 --configs route 2>&1 | grep -v "^done\|^jitmarlin:" \
               | tee -a "$OUT/s17b.log"
           done;;
    s18b)  # prepared in session 17 (branch prep-host-fastpath, NOT run; merge it first): MarlinLinear's eager fast path
           # (a per-layer cache of checked launches): the GPU tests of the layer, models and op, the host
           # time per eager call fast vs general vs nn.Linear, then the e2e Llama subset (prefill at
           # 128-512 tokens was host-bound)
           timeout 300 python3 -m pytest -q -rs tests/gpu -k "linear or model or gemm or graph or compile" \
             > "$OUT/s18b_tests.log" 2>&1
           echo "== s18b tests rc=$?"; tail -3 "$OUT/s18b_tests.log"
           timeout 120 python3 benchmarks/probe_host.py --m 1,16,128,512 2>&1 | grep -v "^jitmarlin:" | tee -a "$OUT/s18b.log"
           timeout 120 python3 benchmarks/probe_host.py --shape 4096x22016 --m 1,128 2>&1 | grep -v "^jitmarlin:" \
             | tee -a "$OUT/s18b.log"
           timeout 240 python3 benchmarks/bench_e2e.py --models llama --variants fp16,w4,w4-fused --batches 1,8 \
             --prefill 128,512,1024 --decode 128 --json "$OUT/s18b_e2e.json" > "$OUT/s18b_e2e.log" 2>&1
           echo "== s18b e2e rc=$?"; grep -A30 "^Ratios" "$OUT/s18b_e2e.log" | head -24;;
    s18c)  # session 18: the e2e decode with torch.compile for every variant (fp16 too), then the CUDA graph
           timeout ${E2E_TIMEOUT:-540} python3 benchmarks/bench_e2e.py --models llama --variants fp16,w4,w4-fused \
             --batches ${E2E_BATCHES:-1,8} --prefill ${E2E_PREFILL:-128} --decode 128 --compile --time-budget 480 \
             --json "$OUT/s18c_e2e.json" > "$OUT/s18c_e2e.log" 2>&1
           echo "== s18c e2e rc=$?"; grep -v "^W1\|^jitmarlin:" "$OUT/s18c_e2e.log" | grep -A30 "B=\|^Ratios" | head -60;;
    s19a)  # session 19: the producer form of the 256-feature configs (two compute warpgroups + the producer
           # warpgroup, one CTA per SM), whose stages hold as many weight bytes as activation bytes at 64
           # tokens (the 128-feature form: 1/2); tests, then route vs the new forms at M = 17-64
           timeout 300 python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py -k "producer_form" > "$OUT/s19a_tests.log" 2>&1
           echo "== s19a tests rc=$?"; tail -3 "$OUT/s19a_tests.log"
           S6=8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x4096
           X=32-2-8-p,32-2-12-p,64-2-8-p,64-2-12-p,128-2-4-p,128-2-8-p
           timeout 120 python3 benchmarks/probe_configs.py --settle 0.1 --m 17,32 --extra-wgmma $X --shapes $S6 \
             --configs route,wgmma-n32-f2-s8-p,wgmma-n32-f2-s12-p 2>&1 | grep "us (floor" | tee -a "$OUT/s19a.log"
           timeout 120 python3 benchmarks/probe_configs.py --settle 0.1 --m 33,64 --extra-wgmma $X --shapes $S6 \
             --configs route,wgmma-n64-f2-s8-p,wgmma-n64-f2-s12-p 2>&1 | grep "us (floor" | tee -a "$OUT/s19a.log";;
    s19f)  # session 19 (after "tests"): the data path alone of the routed producer form (64, 1, 6) and the
           # 256-feature one at M = 64; repeated forwards of a small Llama (fp16 / W4 / W4 fused) bit for bit
           X=64-2-8-p,64-2-12-p
           JITMARLIN_NVCC_FLAGS="-DJM_WG_NODEQ -DJM_WG_NOMMA" timeout 120 python3 benchmarks/probe_configs.py \
             --settle 0.1 --m 64 --extra-wgmma $X --shapes 8192x28672,28672x8192,8192x8192 \
             --configs route,wgmma-n64-f1-s6,wgmma-n64-f2-s8-p,wgmma-n64-f2-s12-p 2>&1 | grep "us (floor" \
             | sed "s/^/[data only] /" | tee -a "$OUT/s19f.log"
           timeout 120 python3 benchmarks/probe_determinism.py --one default 2>&1 | grep "^determinism" | tee -a "$OUT/s19f.log";;
    s19g)  # session 19: which setting and layer shape makes repeated W4 GEMMs / forwards differ (s19f: a small
           # W4 Llama's logits differed between forwards, NaN at 24 tokens)
           timeout 500 python3 benchmarks/probe_determinism.py 2>&1 | grep "^determinism" | grep -v " 0/30 differ, interleaved 0/30, general path 0/10, NaN outputs 0" \
             | tee -a "$OUT/s19g.log";;
    s19h)  # session 19, after the stream-K fix (no CTA without stages): the wgmma GPU tests (test_few_stages_per_cta
           # is the regression test), then the determinism probe
           timeout ${TESTS_TIMEOUT:-170} python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py > "$OUT/s19h_tests.log" 2>&1
           echo "== s19h tests rc=$?"; tail -3 "$OUT/s19h_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/s19h_tests.log" | head
           timeout 60 python3 benchmarks/probe_determinism.py --one default 2>&1 | grep "^determinism" | tee -a "$OUT/s19h.log";;
    s20b)  # session 20: the producer form's compute alone (-DJM_WG_COMPUTE_ONLY: no copies, no waits) against its data
           # path alone and the whole kernel, with deeper rings (64-1-8-p, 32-1-12-p) at M = 32 / 64
           S4=8192x28672,28672x8192,4096x28672,8192x8192
           CF=route,wgmma-n64-f1-s6-p,wgmma-n64-f1-s8-p,wgmma-n32-f1-s8-p,wgmma-n32-f1-s12-p
           for f in "" "-DJM_WG_COMPUTE_ONLY" "-DJM_WG_NODEQ -DJM_WG_NOMMA"; do
             JITMARLIN_NVCC_FLAGS="$f" timeout 170 python3 benchmarks/probe_configs.py --settle 0.1 --m 32,64 \
               --shapes $S4 --extra-wgmma 64-1-8-p,32-1-12-p --configs $CF 2>&1 | grep "us (floor\|Error\|error" \
               | tee -a "$OUT/s20b.log"
           done;;
    s20c)  # session 20: the compute alone, taken apart (-DJM_WG_COMPUTE_ONLY with -DJM_WG_NODEQ / -DJM_WG_NOMMA / both)
           S4=8192x28672,4096x28672,8192x8192
           for f in "-DJM_WG_COMPUTE_ONLY -DJM_WG_NODEQ" "-DJM_WG_COMPUTE_ONLY -DJM_WG_NOMMA" \
                    "-DJM_WG_COMPUTE_ONLY -DJM_WG_NODEQ -DJM_WG_NOMMA" ${S20C_FLAGS:-}; do
             JITMARLIN_NVCC_FLAGS="$f" timeout 120 python3 benchmarks/probe_configs.py --settle 0.1 --m 32,64 \
               --shapes $S4 --configs ${S20C_CONFIGS:-route} ${S20C_EXTRA:-} 2>&1 | grep "us (floor\|Error\|error" \
               | tee -a "$OUT/s20c.log"
           done;;
    s20d)  # session 20: the producer form with four strips on its one compute warpgroup (256 features, two CTAs per
           # SM): twice the independent dequantization per k16 step, half the steps. Whole kernel and compute alone
           S6=8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x4096
           for f in "" "-DJM_WG_COMPUTE_ONLY"; do
             JITMARLIN_NVCC_FLAGS="$f" timeout 200 python3 benchmarks/probe_configs.py --settle 0.1 --m 24,32,48,64 \
               --shapes $S6 --extra-wgmma 32-2-8-p,32-2-6-p,64-2-6-p \
               --configs route,wgmma-n32-f1-s8-p,wgmma-n32-f2-s8-p,wgmma-n32-f2-s6-p,wgmma-n64-f1-s6-p,wgmma-n64-f2-s6-p \
               2>&1 | grep "us (floor\|Error\|error" | tee -a "$OUT/s20d.log"
           done;;
    s20e)  # session 20: per-instruction stall samples (ncu source page, SASS) of the routed 32-token producer kernel,
           # whole and compute alone (-DJM_WG_COMPUTE_ONLY), 8192x28672 M=32
           for f in "" "-DJM_WG_COMPUTE_ONLY"; do
             tag=${f:+co}; tag=${tag:-full}
             JITMARLIN_NVCC_FLAGS="$f" timeout 150 ncu --clock-control none --section WarpStateStats --section SourceCounters \
               --section SpeedOfLight --import-source no -k regex:jm_wgmma -s 2 -c 1 -o "$OUT/s20e_$tag" -f \
               python3 benchmarks/profile_gemm.py --k 8192 --n 28672 --m ${S20E_M:-32} > "$OUT/s20e_$tag.log" 2>&1
             echo "s20e $tag rc=$?"; grep -E "Duration|Throughput|Issued|Eligible|Active Warps" "$OUT/s20e_$tag.log" | head -12
             timeout 60 ncu -i "$OUT/s20e_$tag.ncu-rep" --page source --csv --print-source sass \
               > "$OUT/s20e_${tag}_sass.csv" 2>&1; echo "source page rc=$? $(wc -l < "$OUT/s20e_${tag}_sass.csv") lines"
             rm -f "$OUT/s20e_$tag.ncu-rep"
           done;;
    s20f)  # session 20: the 32-token producer form at three CTAs per SM (12 compute warps per SM, one accumulator
           # set, 120 registers): whole kernel and compute alone, against the two-CTA two- and four-strip forms
           S6=8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x4096
           for f in "" "-DJM_WG_COMPUTE_ONLY"; do
             JITMARLIN_NVCC_FLAGS="$f" timeout 200 python3 benchmarks/probe_configs.py --settle 0.1 --m ${S20F_M:-17,32} \
               --shapes $S6 --extra-wgmma 32-1-6-p3,32-1-7-p3 \
               --configs route,wgmma-n32-f1-s8-p,wgmma-n32-f2-s6-p,wgmma-n32-f1-s6-p,wgmma-n32-f1-s7-p \
               2>&1 | grep "us (floor\|Error\|error" | tee -a "$OUT/s20f.log"
           done;;
    s20g)  # session 20 (run; the early read was reverted, so both builds are now the same): the producer form
           # reading the next stage's words one k16 step before the boundary (default then)
           # against at the boundary (-DJM_WG_NO_EARLY_PRELOAD); routes and the three-CTA 32-token config
           S6=8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x4096
           for f in "" "-DJM_WG_NO_EARLY_PRELOAD"; do
             JITMARLIN_NVCC_FLAGS="$f" timeout 200 python3 benchmarks/probe_configs.py --settle 0.1 --m ${S20G_M:-32,64} \
               --shapes $S6 --extra-wgmma 32-1-6-p3 \
               --configs route,wgmma-n32-f1-s8-p,wgmma-n32-f2-s6-p,wgmma-n32-f1-s6-p,wgmma-n64-f1-s6-p \
               2>&1 | grep "us (floor\|Error\|error" | tee -a "$OUT/s20g.log"
           done;;
    s20h)  # session 20 (run; its kernel change reverted, so this stage now stops at the config check): 64-token tiles
           # in the producer form at three CTAs per SM (two fragment buffers), M = 33-64
           S6=8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x4096
           timeout 200 python3 benchmarks/probe_configs.py --settle 0.1 --m ${S20H_M:-48,64} \
             --shapes $S6 --extra-wgmma 64-1-5-p3,64-1-4-p3 \
             --configs route,wgmma-n64-f1-s5-p,wgmma-n64-f1-s4-p \
             2>&1 | grep "us (floor\|Error\|error" | tee -a "$OUT/s20h.log";;
    s21c)  # session 21: the wgmma kernel's 16-token tiles (plain, stream-K, producer form at two or three CTAs
           # per SM, deeper rings) against the route at M = 9 / 16: 8-bit weights (#4: 1.7x fp16 at M <= 16) and
           # 4-bit on the #3 shapes (4096x28672, 8192^2)
           S4=8192x28672,28672x8192,4096x28672,8192x8192
           for b in 8 4; do
             sh=$S4; [ $b = 4 ] && sh=4096x28672,8192x8192
             timeout 150 python3 benchmarks/probe_configs.py --settle 0.1 --bits $b --m 9,16 --shapes $sh \
               --extra-wgmma 16-1-8-p,16-1-12-p,16-2-8-p \
               --configs route,wgmma-n16-f1-s8,wgmma-n16-f1-s8-sk,wgmma-n16-f1-s8-p,wgmma-n16-f1-s12-p,wgmma-n16-f2-s8-p \
               2>&1 | grep "us (floor\|Error\|error" | sed "s/^/[u$b] /" | tee -a "$OUT/s21c.log"
             timeout 120 python3 benchmarks/probe_configs.py --settle 0.1 --bits $b --m 9,16 --shapes $sh \
               --extra-wgmma 16-1-8-p3,16-1-12-p3 --configs wgmma-n16-f1-s8-p,wgmma-n16-f1-s12-p \
               2>&1 | grep "us (floor\|Error\|error" | sed "s/^/[u$b three CTAs] /" | tee -a "$OUT/s21c.log"
           done;;
    s21d)  # session 21: where 8-bit M = 9-16 should take the 16-token producer form (s21c: 28672x8192 66.2 -> 60.9 us,
           # 4096x28672 36.8 -> 32.5): fp16 and bf16, M = 9 / 12 / 16, the benchmark and Llama / Qwen-sized shapes
           SH=${S21D_SHAPES:-8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x4096,4096x11008,11008x4096,5120x13824,13824x5120,4096x12288,2048x5632}
           for dt in f16 bf16; do
             timeout 200 python3 benchmarks/probe_configs.py --settle 0.1 --bits 8 --dtype $dt --m 9,12,16 --shapes $SH \
               --extra-wgmma 16-1-8-p,16-1-6-p --configs route,wgmma-n16-f1-s8-p,wgmma-n16-f1-s6-p \
               2>&1 | grep "us (floor\|Error\|error" | tee -a "$OUT/s21d.log"
             timeout 150 python3 benchmarks/probe_configs.py --settle 0.1 --bits 8 --dtype $dt --m 9,16 --shapes $SH \
               --extra-wgmma 16-1-8-p3 --configs wgmma-n16-f1-s8-p \
               2>&1 | grep "us (floor\|Error\|error" | sed "s/^/[three CTAs] /" | tee -a "$OUT/s21d.log"
           done;;
    s22a)  # session 22: one 64-column unit per CTA, K split only inside the CTA (k-split warps meeting in shared
           # memory), so no unit is split across CTAs and the global fixup (3-5 us at M = 1-16, NOTES session 11)
           # never runs: N / 64 CTAs (-g), against the route, M = 1 / 16
           P="timeout 240 python3 benchmarks/probe_configs.py --settle 0.1 --m 1,16"
           T1=w16_k128_s8_bk_ks4,w16_k128_s12_bk_ks4,w16_k128_s12_bk_ks8,w8_k128_s12_bk_ks4,w8_k128_s12_bk_ks8
           for sh in 8192x8192 28672x8192; do
             $P --shapes $sh --extra-tiles $T1 --configs route,w16_k128_s8_bk_ks4-w1-g128,w16_k128_s12_bk_ks4-w1-g128,w16_k128_s12_bk_ks8-w1-g128,w8_k128_s12_bk_ks4-w1-g128,w8_k128_s12_bk_ks8-w1-g128 \
               2>&1 | grep "us (floor\|Error\|error" | tee -a "$OUT/s22a.log"
           done
           T2=w16_k128_s4_bk_ks4,w8_k128_s6_bk_ks4
           for sh in 4096x28672 8192x28672; do
             $P --shapes $sh --extra-tiles $T2 --configs route,w16_k128_s4_bk_ks4-w1-g448,w16_k128_s4_bk_ks4-w2-g224,w8_k128_s6_bk_ks4-w1-g448,w8_k128_s6_bk_ks4-w2-g224 \
               2>&1 | grep "us (floor\|Error\|error" | tee -a "$OUT/s22a.log"
           done;;
    s22b)  # session 22 (run; the resident-row act-order twins were not kept, so this stage only says so):
           # act-order at M <= 8 with the A rows whole in the GEMM's shared memory and the producer warp gathering
           # each k tile's columns there (no gather kernel); design and numbers in NOTES.md, session 22
           echo "s22b: the AROWS twins are not on main (NOTES.md, session 22); nothing to run";;
    s21e)  # session 21 (run; the kept-registers change was reverted, so both builds are now the same): the wgmma
           # kernel keeping a group's scale registers over its second stage (default then) against reloading them
           # at every stage (-DJM_WG_RELOAD_GROUPS; bit-identical results), routes at M = 32 / 64 / 256
           S6=8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x4096
           for f in "" "-DJM_WG_RELOAD_GROUPS" "" "-DJM_WG_RELOAD_GROUPS"; do
             JITMARLIN_NVCC_FLAGS="$f" timeout 150 python3 benchmarks/probe_configs.py --settle 0.1 --m ${S21E_M:-32,64,256} \
               --shapes ${S21E_SHAPES:-$S6} --configs route 2>&1 | grep "us (floor\|Error\|error" \
               | sed "s/^/[$f] /" | tee -a "$OUT/s21e.log"
           done;;
    s20a)  # prepared in session 19 (NOT run): where the wgmma kernel's data path loses at M = 32-64 (alone: 47 us
           # vs a 30 us floor on 8192x28672 M=64). With and without the activation copies (-DJM_WG_NO_ACT: the
           # weight stream alone); the producer route and the plain kernel. Activations are re-read from L2 by
           # every feature tile (235 MB at M=64 on 8192x28672 against 117 MB of weights)
           S4=8192x28672,28672x8192,4096x28672,8192x8192
           for f in "-DJM_WG_NODEQ -DJM_WG_NOMMA" "-DJM_WG_NODEQ -DJM_WG_NOMMA -DJM_WG_NO_ACT"; do
             JITMARLIN_NVCC_FLAGS="$f" timeout 150 python3 benchmarks/probe_configs.py --settle 0.1 --m 32,64 \
               --shapes $S4 --configs route,wgmma-n64-f1-s6,wgmma-n32-f1-s8 2>&1 | grep "us (floor" | tee -a "$OUT/s20a.log"
           done;;
    s19b)  # session 18's open question: the W4 models' extra 3-4 ms of host time per eager prefill forward at batch
           # 1 (not in the linear calls: probe_host). Per-kernel GPU time and a cProfile of 3 forwards per case
           timeout 240 python3 benchmarks/diag_decode.py profile --layers 8 --variants fp16,w4,w4-fused \
             --cases 1x128,1x512 --top 25 --host-profile 3 > "$OUT/s19b.log" 2>&1
           echo "== s19b rc=$?"; grep "ms per forward\|GPU " "$OUT/s19b.log";;
    s29c)  # session 29: group scales on the fp32 sums (default) against -DJM_WG_NO_GACC, and the MoE blocks of 24
           # at three / four CTAs per SM; interleaved in one process (probe_moe_tiles --ab), three / two rounds
           timeout 200 python3 benchmarks/probe_moe_tiles.py --shapes mixtral --tokens 48,64,80,96 --rounds 3 \
             --ab "flags=none,ctas=24-1-6:4;flags=-DJM_WG_NO_GACC,ctas=24-1-6:4;flags=none,ctas=24-1-6:3" \
             > "$OUT/s29c_moe.log" 2>&1
           echo "s29c moe rc=$?"; grep "us$" "$OUT/s29c_moe.log" | sed 's/.*\] \[/[/'
           timeout 100 python3 benchmarks/probe_moe_tiles.py --shapes e64 --tokens 64,256 --rounds 2 \
             --ab "flags=none;flags=-DJM_WG_NO_GACC" > "$OUT/s29c_e64.log" 2>&1
           echo "s29c e64 rc=$?"; grep "us$" "$OUT/s29c_e64.log" | sed 's/.*\] \[/[/';;
    s30e)  # session 30 (probe only, no route change): E=64's plain-form blocks of 32 with two strips per warpgroup
           # (256 features per CTA, 139 registers, no spills) now that they take the group-scale form with the
           # late fold; session 17 measured two strips 20% slower without it. Interleaved, two rounds. Result:
           # still 18% slower (256 tokens 168.8 / 170.4 vs 197.9 / 198.9 us): one strip stays.
           timeout 150 python3 benchmarks/probe_moe_tiles.py --shapes e64 --tokens 96,256 --rounds 2 \
             --ab "fw=0;fw=2" > "$OUT/s30e_e64_fw.log" 2>&1
           echo "s30e rc=$?"; grep "us$" "$OUT/s30e_e64_fw.log" | sed 's/.*\] \[/[/';;
    s31a)  # PREPARED in session 30 (diagnostic, no route change): why bf16 loses with group scales on the fp32
           # sums in the 64-token producer form (8192x28672 M=64 75.1 -> 77.1 us) while fp16 gains. ncu of the
           # routed wgmma kernel: fp16 with / without the form (default / -DJM_WG_NO_GACC), bf16 without / with
           # it (default / -DJM_WG_GACC_BF16: bf16 by the fp16 rule); stall reasons, issue, instructions.
           for v in f16:none f16:-DJM_WG_NO_GACC bf16:none bf16:-DJM_WG_GACC_BF16; do
             dt=${v%%:*}; f=${v#*:}
             if [ $f = none ]; then unset JITMARLIN_NVCC_FLAGS; else export JITMARLIN_NVCC_FLAGS=$f; fi
             python3 benchmarks/profile_gemm.py --k 8192 --n 28672 --m 64 --dtype $dt > /dev/null 2>&1  # build first
             timeout 120 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
               --section InstructionStats --section LaunchStats --section Occupancy \
               --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -k regex:jm_wgmma -s 2 -c 1 \
               python3 benchmarks/profile_gemm.py --k 8192 --n 28672 --m 64 --dtype $dt > "$OUT/s31a_${dt}_${f}.txt" 2>&1
             echo "== $dt $f rc=$?"; grep -E "jm_wgmma|Duration|Registers|Issued Ipc|No Eligible|Eligible Warps" "$OUT/s31a_${dt}_${f}.txt" | head -8
             grep -E "issue_stalled" "$OUT/s31a_${dt}_${f}.txt" | sort -k3 -g -r | head -8
           done
           unset JITMARLIN_NVCC_FLAGS;;
    s31b)  # session 31: SiLU-mul in the gate/up producer form's epilogue (moe_gemm_silu). GPU tests of the MoE
           # kernels (the wgmma MoE tests, test_moe_gpu, test_moe_util_gpu), then the Mixtral layer with it off /
           # on, interleaved, three rounds (prediction: -5 .. -10 us per layer at 48-256 tokens).
           timeout ${TESTS_TIMEOUT:-330} python3 -m pytest -q -rs --maxfail=20 tests/gpu/test_wgmma_gpu.py \
             tests/gpu/test_moe_gpu.py tests/gpu/test_moe_util_gpu.py -k "moe or silu" > "$OUT/s31b_tests.log" 2>&1
           echo "s31b tests rc=$?"; tail -15 "$OUT/s31b_tests.log"
           timeout 200 python3 benchmarks/probe_moe_tiles.py --shapes mixtral --tokens 48,64,96,256 --rounds 3 \
             --ab "silu=0;silu=1" > "$OUT/s31b_ab.log" 2>&1
           echo "s31b ab rc=$?"; grep "us$" "$OUT/s31b_ab.log" | sed 's/.*\] \[/[/';;
    s31c)  # session 31: where the SiLU epilogue's time goes (Mixtral 64 / 256 tokens): the route's chain with and
           # without it (prefix graph times) and the gate/up GEMM with / without it and SiLU-gather alone, twice;
           # per-kernel eager GPU time of the layer with it off / on
           for r in 1 2; do
             timeout 150 python3 benchmarks/probe_moe_chain.py --shapes mixtral --tokens 64,256 --gathered --silu-epi \
               --dense 0 > "$OUT/s31c_chain$r.log" 2>&1
             echo "s31c chain$r rc=$?"; grep -E "prefix|alone" "$OUT/s31c_chain$r.log"
           done
           timeout 150 python3 benchmarks/profile_moe.py --shapes mixtral --tokens 64,256 --silu-epi 0,1 \
             > "$OUT/s31c_prof.log" 2>&1
           echo "s31c prof rc=$?"; grep -v "^jitmarlin" "$OUT/s31c_prof.log" | head -60;;
    s31d)  # session 31 (diagnostic): why the gate/up GEMM with the SiLU epilogue is slower alone (Mixtral 64 / 256
           # tokens: 185 -> 192, 347 -> 369 us): its SiLU arithmetic (-DJM_SILU_PLAIN_EPI: the remapped strips
           # without it) or the remapped strips (-DJM_SILU_NO_REMAP: the epilogue on the usual strips)
           for f in none -DJM_SILU_PLAIN_EPI -DJM_SILU_NO_REMAP none; do
             if [ $f = none ]; then unset JITMARLIN_NVCC_FLAGS; else export JITMARLIN_NVCC_FLAGS=$f; fi
             timeout 120 python3 benchmarks/probe_moe_chain.py --shapes mixtral --tokens 64,256 --gathered --silu-epi \
               --dense 0 > "$OUT/s31d_$f.log" 2>&1
             echo "== $f rc=$?"; grep -E "alone" "$OUT/s31d_$f.log"
           done
           unset JITMARLIN_NVCC_FLAGS;;
    s31e)  # session 31: the SiLU epilogue with the approximate quotient in silu_times (no slow-path branch per
           # value): MoE GPU tests, the Mixtral layer off / on (three rounds), the gate/up GEMM alone
           timeout ${TESTS_TIMEOUT:-330} python3 -m pytest -q -rs --maxfail=20 tests/gpu/test_wgmma_gpu.py \
             tests/gpu/test_moe_gpu.py tests/gpu/test_moe_util_gpu.py -k "moe or silu" > "$OUT/s31e_tests.log" 2>&1
           echo "s31e tests rc=$?"; tail -4 "$OUT/s31e_tests.log"
           timeout 200 python3 benchmarks/probe_moe_tiles.py --shapes mixtral --tokens 48,64,96,256 --rounds 3 \
             --ab "silu=0;silu=1" > "$OUT/s31e_ab.log" 2>&1
           echo "s31e ab rc=$?"; grep "us$" "$OUT/s31e_ab.log" | sed 's/.*\] \[/[/'
           timeout 120 python3 benchmarks/probe_moe_chain.py --shapes mixtral --tokens 64,256 --gathered --silu-epi \
             --dense 0 > "$OUT/s31e_chain.log" 2>&1
           echo "s31e chain rc=$?"; grep -E "prefix|alone" "$OUT/s31e_chain.log";;
    s31h)  # session 31: small experts (E=64) take the cover rule on the producer form from 25 rows per expert
           # (moe.small_cover). MoE GPU tests; the layer with the rule off / on, two rounds; bench_moe at the token
           # counts it changes, with Humming
           timeout ${TESTS_TIMEOUT:-330} python3 -m pytest -q -rs --maxfail=20 tests/gpu/test_wgmma_gpu.py \
             tests/gpu/test_moe_gpu.py tests/gpu/test_moe_util_gpu.py -k "moe or silu" > "$OUT/s31h_tests.log" 2>&1
           echo "s31h tests rc=$?"; tail -4 "$OUT/s31h_tests.log"
           timeout 200 python3 benchmarks/probe_moe_tiles.py --shapes e64 --tokens 256,288,384,448,512,640,768,896 \
             --rounds 2 --ab "smallcover=0;smallcover=25" > "$OUT/s31h_ab.log" 2>&1
           echo "s31h ab rc=$?"; grep "us$" "$OUT/s31h_ab.log" | sed 's/.*\] \[/[/'
           timeout 200 python3 benchmarks/bench_moe.py --shapes e64 --tokens 288,384,512,768 --json "$OUT/s31h_moe.json" \
             > "$OUT/s31h_moe.log" 2>&1
           echo "s31h moe rc=$?"; grep -E "^\| e64" "$OUT/s31h_moe.log";;
    s32a)  # PREPARED in session 31 (probe only, no route change): the MoE producer form's blocks of 48 at three
           # CTAs per SM (12 compute warps per SM instead of 8; without the group-scale form, which spilled there;
           # compiles clean, SASS of the built kernels unchanged) where ncu found the E=64 288-token GEMMs
           # latency-bound (0.6 eligible warps per scheduler). E=64 288-384 tokens and Mixtral 128 / 160 tokens
           # (blocks of 48), two rounds each, interleaved.
           timeout 150 python3 benchmarks/probe_moe_tiles.py --shapes e64 --tokens 288,320,384 --rounds 2 \
             --ab "ctas=48-1-6:2;ctas=48-1-6:3" > "$OUT/s32a_e64.log" 2>&1
           echo "s32a e64 rc=$?"; grep "us$" "$OUT/s32a_e64.log" | sed 's/.*\] \[/[/'
           timeout 150 python3 benchmarks/probe_moe_tiles.py --shapes mixtral --tokens 128,160 --rounds 2 \
             --ab "ctas=48-1-6:2;ctas=48-1-6:3" > "$OUT/s32a_mixtral.log" 2>&1
           echo "s32a mixtral rc=$?"; grep "us$" "$OUT/s32a_mixtral.log" | sed 's/.*\] \[/[/';;
    s33a)  # PREPARED in session 32 (probe only, no route change): with blocks of 32 at four CTAs per SM and 48 at
           # three (session 32), E=64 jumps from 159 us at 256 tokens (24 rows per expert, blocks of 32) to 186 at 288
           # (27 rows: small_cover's blocks of 48). Are blocks of 32 still faster past 25 rows, although some experts
           # then take a second block? E=64 272-352 tokens and Mixtral 96-112 tokens, blocks 0 (the rule) / 32 / 48,
           # each timed twice in one process (same routing draw per token count).
           timeout 150 python3 benchmarks/probe_moe_tiles.py --shapes e64 --tokens 272,288,320,352 --block 0,32,48,0,32,48 \
             > "$OUT/s33a_e64.log" 2>&1
           echo "s33a e64 rc=$?"; grep "us$" "$OUT/s33a_e64.log" | sed 's/.*block=/block=/'
           timeout 150 python3 benchmarks/probe_moe_tiles.py --shapes mixtral --tokens 96,104,112 --block 0,32,48,0,32,48 \
             > "$OUT/s33a_mixtral.log" 2>&1
           echo "s33a mixtral rc=$?"; grep "us$" "$OUT/s33a_mixtral.log" | sed 's/.*block=/block=/'
           # and at large batch (E=64 512-1024 tokens: 48-96 rows per expert, the rule's 80 / 96 / 128): several
           # blocks of 32 or 48 per expert instead (small experts' weights are cheap to stream again)
           timeout 150 python3 benchmarks/probe_moe_tiles.py --shapes e64 --tokens 512,768,1024 --block 0,32,48,0,32,48 \
             > "$OUT/s33a_e64_large.log" 2>&1
           echo "s33a e64 large rc=$?"; grep "us$" "$OUT/s33a_e64_large.log" | sed 's/.*block=/block=/';;
    s33b)  # session 33: 4-bit small experts keep blocks of 32 below moe.WGMMA_32_SMALL_U4_HI = 28 rows per expert
           # (s33a: 32 beat the rule's 48 at 25.5 / 27 rows by 7-10%, lost at 30). Where is the edge? E=64
           # 296 / 304 / 312 tokens (27.75 / 28.5 / 29.25 rows), blocks 32 / 48, twice each.
           timeout 150 python3 benchmarks/probe_moe_tiles.py --shapes e64 --tokens 296,304,312 --block 32,48,32,48 \
             > "$OUT/s33b_edge.log" 2>&1
           echo "s33b edge rc=$?"; grep "us$" "$OUT/s33b_edge.log" | sed 's/.*block=/block=/'
           # small experts' blocks of 24 on the producer form (four CTAs per SM, m64n24k16; choose_block_size
           # never picks them for small experts) against the rule (32 up to 27.99 rows, then 48 / 80)
           timeout 200 python3 benchmarks/probe_moe_tiles.py --shapes e64 --tokens 128,192,256,320,384,448 \
             --ab "smallblocks=24+32" --rounds 2 --block 0,24 > "$OUT/s33b_b24.log" 2>&1
           echo "s33b b24 rc=$?"; grep "us$" "$OUT/s33b_b24.log" | sed 's/.*block=/block=/'
           # bf16 at 288 tokens: the new rule (32) against 48, twice
           timeout 100 python3 benchmarks/probe_moe_tiles.py --shapes e64 --dtype bf16 --tokens 288 --block 0,48,0,48 \
             > "$OUT/s33b_bf16.log" 2>&1
           echo "s33b bf16 rc=$?"; grep "us$" "$OUT/s33b_bf16.log" | sed 's/.*block=/block=/'
           # ours against Humming's two GEMMs at the rule's new points (E=64 272 / 288 tokens; 256 as the anchor)
           timeout 200 python3 benchmarks/bench_moe.py --shapes e64 --tokens 256,272,288 --json "$OUT/s33b_moe.json" \
             > "$OUT/s33b_moe.log" 2>&1
           echo "s33b moe rc=$?"; grep -E "^\| " "$OUT/s33b_moe.log" | tail -5
           # where E=64's time goes at 256 / 384 tokens (Humming's two GEMMs lead by 12-22% there): kernels' GPU time
           timeout 100 python3 benchmarks/profile_moe.py --shapes e64 --tokens 256,384 > "$OUT/s33b_prof.log" 2>&1
           echo "s33b prof rc=$?"; grep -v "^jitmarlin" "$OUT/s33b_prof.log" | head -40;;
    s33c)  # session 33: small experts' blocks of 24 (moe.small_block24, rows per expert in [9, 19)) against 32, at
           # 9 / 10.5 / 15 / 19.5 / 21 rows (E=64 96 / 112 / 160 / 208 / 224 tokens), fp16 and bf16, two rounds
           timeout 200 python3 benchmarks/probe_moe_tiles.py --shapes e64 --tokens 96,112,160,208,224 \
             --ab "small24=0;small24=9-22" --rounds 2 > "$OUT/s33c_b24.log" 2>&1
           echo "s33c b24 rc=$?"; grep "us$" "$OUT/s33c_b24.log" | sed 's/.*block=/block=/'
           timeout 150 python3 benchmarks/probe_moe_tiles.py --shapes e64 --dtype bf16 --tokens 128,192 \
             --ab "small24=0;small24=9-22" --rounds 2 > "$OUT/s33c_b24_bf16.log" 2>&1
           echo "s33c b24 bf16 rc=$?"; grep "us$" "$OUT/s33c_b24_bf16.log" | sed 's/.*block=/block=/'
           # ours against Humming's two GEMMs where the rules changed (E=64 128 / 192 / 288 / 304 tokens)
           timeout 200 python3 benchmarks/bench_moe.py --shapes e64 --tokens 128,192,288,304 --json "$OUT/s33c_moe.json" \
             > "$OUT/s33c_moe.log" 2>&1
           echo "s33c moe rc=$?"; grep -E "^\| " "$OUT/s33c_moe.log" | tail -5;;
    s34a)  # PREPARED in session 33 (probe only, no route change). E=64 at 7.5-12 rows per expert (80-128 tokens):
           # Humming's two GEMMs run blocks of 16 there at ~104 us, flat from 64 to 112 tokens; ours 121-143 (blocks
           # of 8 up to 9.5 rows, then the producer form's 24), and our 16-row MoE tile (w16_k128_s3_bk_o3) took 145
           # at 80 tokens. (1) the mma.sync kernel's 16-row tiles on these small experts, blocks of 16 forced, beside
           # the rule (0) and blocks of 8, one tile per process (the first line: the built-in o3 tile).
           for tl in "" w16_k64_s6_bk_o3 w16_k64_s4_bk_o3 w16_k128_s5_bk w16_k64_s6_bk w16_k128_s6_bk_dr1; do
             timeout 120 python3 benchmarks/probe_moe_tiles.py --shapes e64 --tokens 80,96,112,128 --block 0,8,16 \
               ${tl:+--tile $tl} > "$OUT/s34a_tile_${tl:-route}.log" 2>&1
             echo "s34a tile ${tl:-route} rc=$?"; grep "us$" "$OUT/s34a_tile_${tl:-route}.log" | sed 's/.*block=/block=/'
           done
           # (2) a 16-row producer-form config (m64n16k16, four CTAs per SM; compiled in session 33 for five 4-bit
           # formats: 64 registers at launch, no spills): blocks of 16 on the wgmma kernel, inputs gathered, E=64
           # and Mixtral
           timeout 200 python3 benchmarks/probe_moe_tiles.py --shapes e64 --tokens 80,96,112,128 --prod-configs 16-1-6 \
             --prod-ctas 16-1-6=4 --prod 1 --ab "smallblocks=16+24+32" --block 16,24 > "$OUT/s34a_prod16.log" 2>&1
           echo "s34a prod16 rc=$?"; grep "us$" "$OUT/s34a_prod16.log" | sed 's/.*block=/block=/'
           # (Mixtral: with --prod 1 the rule's blocks of 16 take that form too; the first run is the baseline)
           timeout 120 python3 benchmarks/probe_moe_tiles.py --shapes mixtral --tokens 32,48,64 --block 0,16,24 \
             > "$OUT/s34a_mixtral_base.log" 2>&1
           echo "s34a mixtral base rc=$?"; grep "us$" "$OUT/s34a_mixtral_base.log" | sed 's/.*block=/block=/'
           timeout 200 python3 benchmarks/probe_moe_tiles.py --shapes mixtral --tokens 32,48,64 --prod-configs 16-1-6 \
             --prod-ctas 16-1-6=4 --prod 1 --block 0,16,24 > "$OUT/s34a_prod16_mixtral.log" 2>&1
           echo "s34a prod16 mixtral rc=$?"; grep "us$" "$OUT/s34a_prod16_mixtral.log" | sed 's/.*block=/block=/';;
    s34b)  # session 34: the 16-row producer form (m64n16k16) beat the mma.sync blocks of 16 on Mixtral (32 tokens
           # 292.7 -> 256.8 us) but not the blocks of 8 where both read each expert once (16 tokens 203.6 vs
           # 256.7). (1) its stages / CTAs per SM, blocks of 16 forced beside the rule, Mixtral and E=64, one
           # config per process; (2) ncu of the Mixtral 16-token gate/up GEMM: blocks of 8 (mma.sync o3) against
           # blocks of 16 (16-1-6 at four CTAs): why the same bytes take longer.
           for c in 16-1-6=4 16-1-7=4 16-1-6=3 16-1-10=3 16-1-8=2; do
             timeout 150 python3 benchmarks/probe_moe_tiles.py --shapes mixtral,e64 --tokens 16,32,40,80 --block 0,16 \
               --prod-configs ${c%%=*} --prod-ctas $c --prod 1 > "$OUT/s34b_$c.log" 2>&1
             echo "s34b $c rc=$?"; grep "us$" "$OUT/s34b_$c.log" | sed 's/.*block=/block=/'
           done
           for v in 8 16; do
             timeout 150 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
               --section Occupancy --section LaunchStats \
               --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -k "regex:jm_(gemm|wgmma).*moe" -c 1 \
               python3 benchmarks/probe_moe_tiles.py --shapes mixtral --tokens 16 --block $v --prod-configs 16-1-6 \
               --prod-ctas 16-1-6=4 --prod 1 > "$OUT/s34b_ncu_$v.txt" 2>&1
             echo "== ncu block $v rc=$?"; grep -E "jm_(gemm|wgmma)|Duration|DRAM Throughput|Registers|Issued Ipc|No Eligible|Eligible Warps|Achieved Occupancy" "$OUT/s34b_ncu_$v.txt" | head -12
             grep -E "issue_stalled" "$OUT/s34b_ncu_$v.txt" | sort -k3 -g -r | head -8
           done;;
    s34c)  # session 34: s34b's sweep again, one shape per process (two shapes in one process trip a probe bug),
           # Mixtral only (E=64 keeps its blocks of 8 there); then bf16 blocks of 16, mma.sync vs the producer form.
           for c in 16-1-6=4 16-1-7=4 16-1-6=3 16-1-10=3 16-1-8=2; do
             timeout 100 python3 benchmarks/probe_moe_tiles.py --shapes mixtral --tokens 16,32,40 --block 16 \
               --prod-configs ${c%%=*} --prod-ctas $c --prod 1 > "$OUT/s34c_$c.log" 2>&1
             echo "s34c $c rc=$?"; grep "us$" "$OUT/s34c_$c.log" | sed 's/.*block=/block=/'
           done
           for pr in "" "--prod-configs 16-1-6 --prod-ctas 16-1-6=4 --prod 1"; do
             timeout 100 python3 benchmarks/probe_moe_tiles.py --shapes mixtral --tokens 32,40 --block 16 --dtype bf16 \
               $pr > "$OUT/s34c_bf16_${pr:+prod}.log" 2>&1
             echo "s34c bf16 ${pr:-mma.sync} rc=$?"; grep "us$" "$OUT/s34c_bf16_${pr:+prod}.log" | sed 's/.*block=/block=/'
           done;;
    s34d)  # session 34: blocks of 16 on the 4-bit producer form (16, 1, 6) at four CTAs per SM, routed for large
           # experts (7.2-12 rows per expert). The layer with blocks of 16 off / on that form (probe --ab prodblocks),
           # two interleaved rounds, fp16 then bf16; the mma.sync 8 / producer 16 boundary (blocks of 8 / 16 forced,
           # 24-32 tokens); bench_moe at Mixtral 32 / 40 / 48 tokens with Humming (carry .whl).
           timeout 200 python3 benchmarks/probe_moe_tiles.py --shapes mixtral --tokens 24,28,32,36,40,44 --rounds 2 \
             --ab "prodblocks=24+32+48+80+96;prodblocks=16+24+32+48+80+96" > "$OUT/s34d_ab.log" 2>&1
           echo "s34d ab rc=$?"; grep "us$" "$OUT/s34d_ab.log" | sed 's/.*\] \[/[/'
           timeout 120 python3 benchmarks/probe_moe_tiles.py --shapes mixtral --tokens 32,40 --dtype bf16 \
             --ab "prodblocks=24+32+48+80+96;prodblocks=16+24+32+48+80+96" > "$OUT/s34d_ab_bf16.log" 2>&1
           echo "s34d ab bf16 rc=$?"; grep "us$" "$OUT/s34d_ab_bf16.log" | sed 's/.*\] \[/[/'
           timeout 120 python3 benchmarks/probe_moe_tiles.py --shapes mixtral --tokens 24,28,32 --block 8,16 \
             > "$OUT/s34d_8v16.log" 2>&1
           echo "s34d 8v16 rc=$?"; grep "us$" "$OUT/s34d_8v16.log" | sed 's/.*block=/block=/'
           timeout 200 python3 benchmarks/bench_moe.py --shapes mixtral --tokens 32,40,48 --json "$OUT/s34d_moe.json" \
             > "$OUT/s34d_moe.log" 2>&1
           echo "s34d bench_moe rc=$?"; grep -E "^\||copy|Humming" "$OUT/s34d_moe.log" | head -12;;
    s34e)  # session 34: where blocks of 16 (now the producer form) give way to 24 on Mixtral (WGMMA_COVER_MIN_ROWS = 12
           # rows per expert, set when 16 ran on the mma.sync kernel): blocks of 16 / 24 forced, 44-56 tokens, two
           # token lists (two routing draws per token count)
           for tl in 44,46,48,50,52,54,56 45,47,49,51,53,55; do
             timeout 120 python3 benchmarks/probe_moe_tiles.py --shapes mixtral --tokens $tl --block 16,24 \
               > "$OUT/s34e_$tl.log" 2>&1
             echo "s34e $tl rc=$?"; grep "us$" "$OUT/s34e_$tl.log" | sed 's/.*block=/block=/'
           done;;
    s34f)  # session 34: the mbarrier waits' suspend-time hint (jm_ptx.cuh mbar_wait, -DJM_MBAR_SUSPEND_NS): ncu found
           # the 16-row producer form at 66% issue use for 61% DRAM; if the try-wait loops' re-issues take slots from
           # the compute warps, a longer suspension gives them back. Layer us, none / 1000 / 20000 ns, two rounds.
           for sh in mixtral e64; do
             tk=16,32,64; [ $sh = e64 ] && tk=16,128,256
             timeout 200 python3 benchmarks/probe_moe_tiles.py --shapes $sh --tokens $tk --rounds 2 \
               --ab "flags=none;flags=-DJM_MBAR_SUSPEND_NS=1000;flags=-DJM_MBAR_SUSPEND_NS=20000" > "$OUT/s34f_$sh.log" 2>&1
             echo "s34f $sh rc=$?"; grep "us$" "$OUT/s34f_$sh.log" | sed 's/.*\] \[/[/'
           done;;
    s35a)  # Session 35 (run; NOTES session 35: four strips level, not kept). Prepared in session 34 (probe only). The producer form's compute loop spends ~60 of its
           # 174 instructions per stage and warp on bookkeeping (NOTES session 34) and four CTAs per SM beat three
           # and two. Four strips per CTA (256 features: twice the weights per stage and per bookkeeping, twice
           # the bytes per bulk copy) at three CTAs per SM compile without spills or wgmma serialization for 16
           # rows (f16 g128, bf16 zero points g64) and 24 rows (f16 g128; bf16 zero points spill) with two
           # fragment buffers (-DJM_WG_NB=2; the four-CTA forms already take two), but lose the group scales on
           # the fp32 sums (four strips: the per-weight HMUL2) and the SiLU epilogue (two strips only). Baselines
           # with the SiLU epilogue on / off, then the four-strip forms; same token lists = same routing draws.
           export JITMARLIN_NVCC_FLAGS=-DJM_WG_NB=2
           for sh in mixtral:16:16,32,40 mixtral:24:48,56,64 e64:24:128,160; do
             IFS=: read -r shp blk tks <<< "$sh"
             timeout 150 python3 benchmarks/probe_moe_tiles.py --shapes $shp --tokens $tks --block $blk \
               --ab "silu=1;silu=0" > "$OUT/s35a_base_${shp}_$blk.log" 2>&1
             echo "s35a base $sh rc=$?"; grep "us$" "$OUT/s35a_base_${shp}_$blk.log" | sed 's/.*\] \[/[/'
             timeout 200 python3 benchmarks/probe_moe_tiles.py --shapes $shp --tokens $tks --block $blk \
               --prod-configs $blk-2-6 --prod-ctas $blk-2-6=3 --prod-fw 2 > "$OUT/s35a_fw2_${shp}_$blk.log" 2>&1
             echo "s35a fw2 $sh rc=$?"; grep "us$" "$OUT/s35a_fw2_${shp}_$blk.log" | sed 's/.*block=/block=/'
           done
           unset JITMARLIN_NVCC_FLAGS;;
    s36a)  # PREPARED in session 35 (probe + tests, no route change): small 4-bit experts' blocks of 16 on the
           # producer form (moe.WGMMA_16_ROWS_SMALL_U4, off by default). Session 35, one draw each, E=64 layer us,
           # rule / 16: 88 tokens 131.5 / 125.7, 96 137.7 / 127.6, 104 139.9 / 128.1, 112 140.5 / 132.7, 120 140.9 /
           # 125.3, 128 141.6 / 132.1, 144 142.3 / 142.6; 72 / 80 the rule wins or ties. (1) the tests of that route
           # and of the forms it uses; (2) interleaved A/B in both orders, f16 and bf16. If it holds at 8-13 rows:
           # set WGMMA_16_ROWS_SMALL_U4 = (7.8, 13.0) (and the CPU test's default assert), MoE GPU set, bench_moe.
           # The route, its probe key and tests are the patch benchmarks/prepared/s36a_small16.patch: run
           # `git apply benchmarks/prepared/s36a_small16.patch` here first (and commit it) — the stage checks.
           grep -q WGMMA_16_ROWS_SMALL_U4 jitmarlin/ops/moe.py || { echo "s36a: apply benchmarks/prepared/s36a_small16.patch first"; continue; }
           timeout 240 python3 -m pytest -q -rs tests/gpu -k "small_blocks_of_16 or blocks_of_16 or producer_blocks or ready_tables" \
             > "$OUT/s36a_tests.log" 2>&1
           echo "s36a tests rc=$?"; tail -3 "$OUT/s36a_tests.log"
           for ab in "small16=0;small16=7.8-13" "small16=7.8-13;small16=0"; do
             timeout 150 python3 benchmarks/probe_moe_tiles.py --shapes e64 --tokens 72,80,88,96,104,112,120,128,136,144 \
               --ab "$ab" --rounds 2 > "$OUT/s36a_ab.log" 2>&1
             echo "s36a ab $ab rc=$?"; grep "us$" "$OUT/s36a_ab.log" | sed 's/.*\] \[/[/'
           done
           timeout 100 python3 benchmarks/probe_moe_tiles.py --shapes e64 --dtype bf16 --tokens 88,104,128 \
             --ab "small16=0;small16=7.8-13" --rounds 2 > "$OUT/s36a_bf16.log" 2>&1
           echo "s36a bf16 rc=$?"; grep "us$" "$OUT/s36a_bf16.log" | sed 's/.*\] \[/[/';;
    s36b)  # (Session 37 made the unrolled loop the default: this stage now builds the other side, the rolled
           # loop, with -DJM_WG_ROLLED_RING; what follows is session 35's text.) PREPARED in session 35 (probe flag, default build unchanged: all 592 wgmma cubins' .text identical):
           # the probe flag unrolled the wgmma stage loop over the ring, so each stage's slot, addresses,
           # descriptor and phase bit are constants. SASS here (instructions per stage and warp, default ->
           # unrolled): MoE n16 c4 195 -> 161 (its stream-K loop 186 -> 173), n24 c4 205 -> 171 (194 -> 179), n32 c4
           # 199 -> 173 (191 -> 187), dense n32 c3 213 -> 181, n64 prod 247 -> 213, bf16 u8 MoE n32 312 -> 289; no
           # spills or C75xx; code 1.4x larger. Prediction: 0-4% where these forms are issue-bound (MoE blocks of
           # 16 / 24, dense M = 17-64), nothing elsewhere. (1) the wgmma GPU tests built with the flag; (2) ABAB.
           export JITMARLIN_NVCC_FLAGS=-DJM_WG_ROLLED_RING
           timeout 300 python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py -k "producer or silu or moe or form" \
             > "$OUT/s36b_tests.log" 2>&1
           echo "s36b tests (rolled) rc=$?"; tail -3 "$OUT/s36b_tests.log"
           unset JITMARLIN_NVCC_FLAGS
           for sh in mixtral:32,48,64 e64:128,160,256; do
             IFS=: read -r shp tks <<< "$sh"
             timeout 150 python3 benchmarks/probe_moe_tiles.py --shapes $shp --tokens $tks \
               --ab "flags=none;flags=-DJM_WG_ROLLED_RING;flags=-DJM_WG_ROLLED_RING;flags=none" > "$OUT/s36b_$shp.log" 2>&1
             echo "s36b $shp rc=$?"; grep "us$" "$OUT/s36b_$shp.log" | sed 's/.*\] \[/[/'
           done
           for f in "" -DJM_WG_ROLLED_RING -DJM_WG_ROLLED_RING ""; do
             JITMARLIN_NVCC_FLAGS="$f" timeout 120 python3 benchmarks/probe_configs.py --shapes 8192x28672,4096x28672,8192x8192 \
               --m 17,32,48,64 --configs route > "$OUT/s36b_dense.log" 2>&1
             echo "s36b dense flags=${f:-none} rc=$?"; grep -E "us" "$OUT/s36b_dense.log" | tail -12
           done
           # M = 16 (#3: 4096x28672 2.19x, 8192^2 2.04x fp16 on the mma.sync 16-row tiles): the wgmma 16-token
           # producer form lost there in session 29 (issue-bound); with the ring unrolled?
           for f in "" -DJM_WG_ROLLED_RING; do
             JITMARLIN_NVCC_FLAGS="$f" timeout 120 python3 benchmarks/probe_configs.py --shapes 4096x28672,8192x8192,8192x28672 \
               --m 16 --configs route,wgmma-n16-f1-s8-p,wgmma-n16-f1-s8-sk-p > "$OUT/s36b_m16.log" 2>&1
             echo "s36b M=16 flags=${f:-none} rc=$?"; grep -E "us" "$OUT/s36b_m16.log" | tail -9
           done;;
    s37a)  # session 37, after the wgmma stage loop was unrolled over its ring by default: (1) small experts' blocks
           # of 16 (WGMMA_16_ROWS_SMALL_U4) again, ABAB, f16 and bf16; (2) the 16-token producer form (16, 1, 8) vs
           # the route at M = 9 / 16 for 4-bit weights on the Llama / Mixtral shapes, f16 and bf16, two passes.
           for dt in f16 bf16; do
             timeout 150 python3 benchmarks/probe_moe_tiles.py --shapes e64 --dtype $dt --tokens 80,88,96,104,112,120,128,136,144 \
               --ab "small16=0;small16=7.8-13" --rounds 2 > "$OUT/s37a_moe_$dt.log" 2>&1
             echo "s37a moe $dt rc=$?"; grep "us$" "$OUT/s37a_moe_$dt.log" | sed 's/.*\] \[/[/'
           done
           for dt in f16 bf16 f16; do
             timeout 150 python3 benchmarks/probe_configs.py --dtype $dt --m 9,16 --configs route,wgmma-n16-f1-s8-p \
               --shapes ${S37_SHAPES:-4096x4096,4096x11008,11008x4096,4096x12288,5120x13824,13824x5120,14336x4096,4096x22016,4096x28672,8192x8192,28672x8192,8192x28672} \
               > "$OUT/s37a_n16_$dt.log" 2>&1
             echo "s37a n16 $dt rc=$?"; grep -E " us" "$OUT/s37a_n16_$dt.log"
           done;;
    s38a)  # Prepared in session 37, measured in session 38 (NOTES.md; probe only): the dense 16-token producer form at three / four
           # CTAs per SM for 4-bit M = 9-16. (16, 1, 8) at two CTAs won only on three shapes in s37a (8192^2,
           # 4096x11008, 11008x4096) and lost 8-20% on the N = 28672 / K = 28672 shapes; the MoE form's (16, 1, 6)
           # went 327 -> 256 us from two to four CTAs per SM on Mixtral (session 34). Built here (sm_90a, ptxas):
           # 64 registers, no spills, f16 / bf16, 4 / 8 bits. If four CTAs win broadly: route it (gemm.WGMMA_PROD_N16 /
           # WGMMA_PROD_N16_U4_SHAPES) and add it to K.WGMMA_PROD_CONFIGS with K.WGMMA_PROD_CTAS_U4.
           for dt in f16 bf16; do
             timeout 200 python3 benchmarks/probe_configs.py --dtype $dt --m 9,16 --extra-wgmma 16-1-6-p4,16-1-7-p3 \
               --configs route,wgmma-n16-f1-s8-p,wgmma-n16-f1-s6-p,wgmma-n16-f1-s7-p \
               --shapes ${S38_SHAPES:-4096x4096,4096x11008,11008x4096,4096x12288,14336x4096,4096x28672,8192x8192,28672x8192,8192x28672} \
               > "$OUT/s38a_$dt.log" 2>&1
             echo "s38a $dt rc=$?"; grep -E " us" "$OUT/s38a_$dt.log"
           done;;
    s38b)  # session 38 (probe only): prefill alternatives at M = 192 / 256 / 384 (the 64-token producer form with
           # its own splits or stream-K, the wide form with 2 K splits) against the route; M = 48 / 64 on 14336x4096
           # and 8192^2; the 16-token producer form at three CTAs per SM ((16, 1, 7)) on Llama-class shapes
           P=benchmarks/probe_configs.py
           timeout 150 python3 $P --dtype f16 --m 192,256,384 --shapes 8192x28672,28672x8192,4096x28672,8192x8192,14336x4096 \
             --configs route,wgmma-n64-f1-s6-p,wgmma-n64-f1-s6-sk-p,wgmma-n128-f2-s4-k2-w > "$OUT/s38b_prefill.log" 2>&1
           echo "s38b prefill rc=$?"; grep " us" "$OUT/s38b_prefill.log"
           timeout 100 python3 $P --dtype f16 --m 48,64 --shapes 14336x4096,8192x8192 --extra-wgmma 64-1-8-p \
             --configs route,wgmma-n64-f1-s6-p,wgmma-n64-f1-s6-sk-p,wgmma-n64-f1-s8-p,wgmma-n32-f1-s6-p > "$OUT/s38b_m64.log" 2>&1
           echo "s38b m64 rc=$?"; grep " us" "$OUT/s38b_m64.log"
           for dt in f16 bf16; do
             timeout 120 python3 $P --dtype $dt --m 9,16 --extra-wgmma 16-1-7-p3 \
               --shapes 4096x12288,4096x22016,11008x4096,4096x11008,5120x13824,13824x5120,14336x4096 \
               --configs route,wgmma-n16-f1-s7-p,wgmma-n16-f1-s8-p > "$OUT/s38b_n16_$dt.log" 2>&1
             echo "s38b n16 $dt rc=$?"; grep " us" "$OUT/s38b_n16_$dt.log"
           done;;
    s39a)  # PREPARED in session 38 (probe only; the default kernels' machine code is unchanged by it): the producer
           # form with two compute warpgroups of two strips (K.WGMMA_PROD2_CONFIGS: 256 features x NT tokens per CTA,
           # 384 threads, one CTA per SM, 232 registers per compute thread), which can run stream-K at 128 tokens —
           # the lever for M = 128-512, where the route's wide 128-token tiles fill 85% of their last wave (224 tiles
           # of 8192x28672 at M = 256 on 132 SMs) and cannot run stream-K (they spill with it). Built here without
           # C75xx; 28 bytes of spills in the 128-token kernel's stream-K epilogue. Its GPU test first (own timeout),
           # then the probe: route vs the form with whole tiles / stream-K, 4 and 6 stages.
           timeout 240 python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py -k two_warpgroups > "$OUT/s39a_test.log" 2>&1
           echo "s39a test rc=$?"; tail -5 "$OUT/s39a_test.log"
           timeout 300 python3 benchmarks/probe_configs.py --dtype f16 --m 128,256,384,512,1024 \
             --extra-wgmma 128-2-4-p2,128-2-6-p2 \
             --configs route,wgmma-n128-f2-s4-p2,wgmma-n128-f2-s4-sk-p2,wgmma-n128-f2-s6-sk-p2 \
             --shapes ${S39_SHAPES:-8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x12288,4096x22016} \
             > "$OUT/s39a.log" 2>&1
           echo "s39a rc=$?"; grep " us" "$OUT/s39a.log"
           for v in "--dtype bf16" "--bits 8"; do  # the other formats' view, fewer cells
             timeout 150 python3 benchmarks/probe_configs.py $v --m 256,1024 --extra-wgmma 128-2-4-p2 \
               --configs route,wgmma-n128-f2-s4-sk-p2 --shapes 8192x28672,28672x8192,4096x28672 2>&1 | grep " us" \
               | tee -a "$OUT/s39a_formats.log"
           done;;
    s39b)  # session 39: the route's 128-token stream-K rule (gemm.wgmma_route_stream2: the two-compute-warpgroup
           # producer form (128, 2, 4) where whole 128-token tiles fill the SMs' rounds under 0.8). Its GPU tests and
           # their neighbours first, then route (with the rule) vs route0 (without) where it fires and around it.
           timeout 300 python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py \
             -k "two_warpgroup or capture_of_a_new or producer_form_route or test_shapes or route_through or stream_k" \
             > "$OUT/s39b_test.log" 2>&1
           echo "s39b test rc=$?"; tail -5 "$OUT/s39b_test.log"
           timeout 240 python3 benchmarks/probe_configs.py --dtype f16 --m ${S39_M:-96,192,256,320,384,512,640,768} \
             --configs route,route0 \
             --shapes ${S39_SHAPES:-4096x12288,4096x22016,8192x8192,14336x4096,28672x8192,4096x11008,11008x4096,5120x13824,13824x5120,8192x22016} \
             > "$OUT/s39b.log" 2>&1
           echo "s39b rc=$?"; grep " us" "$OUT/s39b.log"
           for v in "--dtype bf16" "--bits 8"; do  # the other formats where it fires
             timeout 100 python3 benchmarks/probe_configs.py $v --m 128,256,384 --configs route,route0 \
               --shapes 4096x12288,4096x22016,8192x8192,28672x8192 2>&1 | grep " us" | tee -a "$OUT/s39b_formats.log"
           done;;
    s39c)  # session 39, after the 48-stage floor (s39b: the rule lost under ~48 stages per stream-K CTA): route vs
           # route0 (without the rule) on the cells it newly fires on and a repeat of the measured ones, interleaved
           # (route, route0, route) for the noise; then the route's GPU tests.
           timeout 200 python3 benchmarks/probe_configs.py --dtype f16 --m ${S39_M:-128,256,320,384,640,768,896,1024} \
             --configs route,route0,route \
             --shapes ${S39_SHAPES:-13824x5120,8192x4096,4096x12288,4096x22016,8192x8192,28672x8192,8192x22016} \
             > "$OUT/s39c.log" 2>&1
           echo "s39c rc=$?"; grep " us" "$OUT/s39c.log"
           timeout 300 python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py \
             -k "two_warpgroup or capture_of_a_new or producer_form_route or test_shapes or route_through or stream_k" \
             > "$OUT/s39c_test.log" 2>&1
           echo "s39c test rc=$?"; tail -5 "$OUT/s39c_test.log";;
    s43a)  # PREPARED in session 42 (main): first the wgmma GPU tests as corrected after s42c (NOT GPU-run yet), then
           # the tall tiles where the table has no row or a row not measured in its own form: two (160, 2, 4) tiles at
           # M = 257-320 (s42b: stream-K 8192x28672 M = 320 253.6 us vs the route 296.0), 256- / 192-token tiles at
           # M = 513-640 and 769-896, each with whole tiles / K splits and with stream-K (-sk)
           timeout ${S43A_TEST_TIMEOUT:-220} python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py > "$OUT/s43a_test.log" 2>&1
           echo "s43a test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s43a_test.log" | tail -12
           timeout ${S43A_TIMEOUT:-300} python3 benchmarks/probe_configs.py --dtype f16 --settle 0.3 \
             --m ${S43A_M:-257,288,320,352,544,600,640,800,896} \
             --configs ${S43A_CONFIGS:-routeT0,route,wgmma-n160-f2-s4-p2,wgmma-n160-f2-s4-sk-p2,wgmma-n192-f1-s6-p2,wgmma-n192-f1-s6-sk-p2,wgmma-n256-f1-s4-p2,wgmma-n256-f1-s4-sk-p2,routeT0} \
             --shapes ${S43A_SHAPES:-8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x12288,4096x11008,4096x4096} \
             > "$OUT/s43a.log" 2>&1
           echo "s43a rc=$?"; grep -c " us" "$OUT/s43a.log"; grep "failed\|Error" "$OUT/s43a.log" | head -5;;
    s48c)  # session 48 (ran with configs route,routeHF8 when the route's fill was 0.9; the same launches are now
           # routeHF9,route): the halving rule at 0.8 x SMs (2 x 56 = 112 CTAs on N = 3584 at M = 129-256 and N = 7168
           # at M = 33-128) and the 144-token tile's two clustered splits, two rounds; Qwen2-7B's hidden 3584
           for r in 1 2; do
             timeout 80 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 --m 160,192,224,256 \
               --configs routeHF9,route,wgmma-n144-f1-s6-k2-p2 --shapes 3072x3584,3584x3584,4096x3584,8192x3584 >> "$OUT/s48c.log" 2>&1
             timeout 60 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 --m 40,64,96,128 --configs routeHF9,route \
               --shapes 3584x7168,4096x7168,7168x7168,8192x7168 >> "$OUT/s48c.log" 2>&1
             echo "s48c $r rc=$?"
           done
           grep -c " us" "$OUT/s48c.log"; grep -ci "err nan\|failed" "$OUT/s48c.log";;
    s48d)  # session 48: the cost model with the 176- / 208- / 224- / 240-token tiles (refit to s43d-s48b) against
           # session 47's (routeC47) on 12 shapes outside s48a/b's fit, M = 300-960 (67 of 108 cells differ on the CPU),
           # two interleaved rounds; then bf16 and fp16 8-bit on three of s48a's shapes, one round
           for r in 1 2; do
             timeout 200 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 300,352,416,448,528,544,624,704,800,960 \
               --configs routeC47,route --shapes 11008x4096,5120x13824,13824x5120,5120x5120,3584x4608,4096x6144,4096x22016,3584x37888,18944x3584,2048x2560,4096x12288,4096x11008 \
               >> "$OUT/s48d.log" 2>&1
             echo "s48d $r rc=$?"
           done
           timeout 60 python3 benchmarks/probe_configs.py --dtype bf16 --settle 0.1 --m 300,416,448,800 --configs routeC47,route \
             --shapes 4096x4096,8192x8192,14336x4096 >> "$OUT/s48d.log" 2>&1
           timeout 60 python3 benchmarks/probe_configs.py --dtype f16 --bits 8 --settle 0.1 --m 300,416,448,800 --configs routeC47,route \
             --shapes 4096x4096,8192x8192,14336x4096 >> "$OUT/s48d.log" 2>&1
           grep -c " us" "$OUT/s48d.log"; grep -ci "err nan\|failed" "$OUT/s48d.log";;
    s48e)  # session 48: the halving rule at lower fills (routeHF7 / 6 / 5: 2 x 48 / 40 / 33+ tiles) on N = 6144 /
           # 5632 / 5120 / 4608 at M = 40-128 and N = 3072 / 2560 at M = 160-256, two rounds; then the new tall tiles
           # whole (automatic K splits) at M = 176-240 (one tile of them, where the table's rows run 192 / 256) on five
           # shapes, one round
           for r in 1 2; do
             timeout 70 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 40,64,96,128 --configs route,routeHF7,routeHF6,routeHF5 \
               --shapes 4096x6144,2048x6144,5120x5120,2048x5632,3584x4608 >> "$OUT/s48e.log" 2>&1
             timeout 70 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 160,192,224,256 --configs route,routeHF7,routeHF6,routeHF5 \
               --shapes 3072x3072,4096x3072,8192x3072,2560x2560 >> "$OUT/s48e.log" 2>&1
             echo "s48e $r rc=$?"
           done
           timeout 120 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 176,200,208,224,240 \
             --configs route,wgmma-n176-f1-s6-p2,wgmma-n208-f1-s6-p2,wgmma-n224-f1-s5-p2,wgmma-n240-f1-s5-p2,wgmma-n256-f1-s4-p2 \
             --shapes 4096x12288,4096x28672,8192x8192,14336x4096,28672x8192 >> "$OUT/s48e.log" 2>&1
           grep -c " us" "$OUT/s48e.log"; grep -ci "err nan\|failed" "$OUT/s48e.log";;
    s49c)  # session 49: the harness floor -- a kernel that only streams a layer's W4 weights (+ g128 scales), timed as
           # bench_gemm times the GEMM (CUDA graph of 20 calls, each on its own copy, PDL on / off), % of the copy floor
           nvcc -std=c++17 -O3 -arch=sm_90a -I cuda_src benchmarks/floor_probe.cu -o /tmp/floor_probe \
             && timeout 120 /tmp/floor_probe > "$OUT/s49c.log" 2>&1; echo "s49c rc=$?"; cat "$OUT/s49c.log";;
    s49d)  # session 49: where the route's time goes at M = 1 / 16 on the shapes farthest from the floor (per-CTA timeline)
           timeout 200 python3 benchmarks/probe_timeline.py --shapes 8192x8192,4096x4096,4096x28672,14336x4096,4096x11008 \
             --m 1,16 2>&1 | grep -v "^jitmarlin:" > "$OUT/s49d.log"; echo "s49d rc=$?"; cat "$OUT/s49d.log";;
    s53p)  # session 53: the strip kernel's trace (benchmarks/strip_probe.cu, plain CUDA): per-group time at M = 1 (g128 vs
           # per-channel, which has no scale loads in the main loop; 16 / 8 / 4 warps; register / shared ring; act-order)
           # and M = 16 (two token blocks)
           # S53P_OLD: a directory holding another jm_strip.cuh (the version before a change), probed first
           for v in ${S53P_OLD:+old} new; do
             inc="-I cuda_src"; [ $v = old ] && inc="-I $S53P_OLD -I cuda_src"
             nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -DJM_STRIP_TRACE $inc benchmarks/strip_probe.cu \
               -o /tmp/strip_probe_$v && echo "== $v" >> "$OUT/s53p.log" && timeout 100 /tmp/strip_probe_$v >> "$OUT/s53p.log" 2>&1
             echo "s53p $v rc=$?"
           done; cat "$OUT/s53p.log";;
    s53s)  # session 53: the strip kernel's GPU tests (after the group-end scale change, cuda_src/jm_strip.cuh pass_on16)
           timeout ${STRIP_TESTS_TIMEOUT:-240} python3 -m pytest -q -rs --maxfail=20 tests/gpu/test_strip_gpu.py \
             > "$OUT/s53s_tests.log" 2>&1
           echo "s53s tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/s53s_tests.log" | head -20; tail -3 "$OUT/s53s_tests.log";;
    s53q)  # session 53: s50a's comparison again after the group-end scale change (pass_on16): every one-block and two-block
           # strip config and routeS against the route at M = 1 / 4 / 8 / 12 / 16 on the bench shapes and the 7B's
           SH=${S53Q_SHAPES:-4096x4096,8192x8192,14336x4096,4096x12288,11008x4096,4096x11008,4096x28672,28672x8192,8192x28672}
           timeout ${S53Q_T1:-220} python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 1,4,8 --shapes $SH \
             --configs route,routeS,strip-w16-c1,strip-w16-c2,strip-w16-c4,strip-w8-c1,strip-w8-c2,strip-w4-c1,strip-w16-c1-s,strip-w16-c2-s,strip-w8-c1-s,strip-w4-c1-s \
             > "$OUT/s53q.log" 2>&1
           echo "s53q probe 1-8 rc=$?"
           timeout ${S53Q_T2:-150} python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 12,16 --shapes $SH \
             --configs route,routeS,strip-w16-c1-t2,strip-w16-c2-t2,strip-w8-c1-t2,strip-w8-c2-t2,strip-w4-c1-t2,strip-w16-c1-t2-s,strip-w16-c2-t2-s,strip-w4-c1-t2-s \
             >> "$OUT/s53q.log" 2>&1
           echo "s53q probe 12-16 rc=$?"; python3 benchmarks/strip_pick.py "$OUT/s53q.log";;
    s53r)  # PREPARED in session 53 (run on branch s53-strip): act-order on the strip route's small shapes at M = 1-8 after
           # the act-order forms stopped stalling per row (gathered halves paired at use): the in-kernel gather up to M = 1
           # (the rule) / up to M = 8, and the gather kernel + the strip plain form (STRIP_GATHER_PLAIN)
           for v in "1 0" "8 0" "1 1"; do
             set -- $v
             timeout 90 python3 benchmarks/probe_act_order.py --m 1,2,4,8 --shapes 4096x4096,2048x2048,4096x1024,8192x2048 \
               --strip-perm-max-m $1 --strip-gather-plain $2 2>&1 | grep -v "^done" | tee -a "$OUT/s53r_actorder.log"
           done;;
    s53a)  # PREPARED in session 52: the GPU files session 52 did not run on its code (the strip kernel routed on small
           # problems): the forced-route strip test (its s52b failure: likely a test bug, fixed), linear, model, tuning,
           # MoE, MoE utilities; then s53b (the wgmma file) and s53c in calls of their own
           timeout ${TESTS_TIMEOUT:-450} python3 -m pytest -q -rs --maxfail=40 \
             tests/gpu/test_strip_gpu.py::test_strip_route_and_fast_path tests/gpu/test_linear_gpu.py \
             tests/gpu/test_model_gpu.py tests/gpu/test_tuning_gpu.py tests/gpu/test_moe_gpu.py tests/gpu/test_moe_util_gpu.py \
             > "$OUT/s53a_tests.log" 2>&1
           echo "s53a tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/s53a_tests.log" | head -20; tail -3 "$OUT/s53a_tests.log";;
    s55a)  # session 55: the first GPU run of session 54's kernel changes (strip kernel's batch-wide waits, rings, act-order
           # permutation in shared memory; the mma.sync epilogue's hoisted bias / routing-weight loads) in one call: the
           # strip tests, the GEMM / MoE tests with a bias or routing weights, then a first timing (M = 1 and 16, four
           # shapes: the route, routeS and the strip configs s53q found nearest)
           timeout ${S55_T1:-170} python3 -m pytest -q -rs --maxfail=20 tests/gpu/test_strip_gpu.py > "$OUT/s55a_strip.log" 2>&1
           echo "s55a strip tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/s55a_strip.log" | head -20; tail -3 "$OUT/s55a_strip.log"
           timeout ${S55_T2:-180} python3 -m pytest -q -rs --maxfail=20 -k "bias or moe or topk" tests/gpu/test_gemm_gpu.py \
             tests/gpu/test_moe_gpu.py > "$OUT/s55a_gemm.log" 2>&1
           echo "s55a gemm/moe tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/s55a_gemm.log" | head -20; tail -3 "$OUT/s55a_gemm.log"
           SH=${S55_SHAPES:-8192x8192,4096x28672,4096x4096,11008x4096}
           timeout ${S55_T3:-100} python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 1 --shapes $SH \
             --configs route,routeS,strip-w16-c1,strip-w16-c2,strip-w16-c4,strip-w16-c1-s,strip-w16-c2-s,strip-w8-c1-s > "$OUT/s55a_probe.log" 2>&1
           echo "s55a probe M=1 rc=$?"
           timeout ${S55_T4:-100} python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 16 --shapes $SH \
             --configs route,routeS,strip-w16-c1-t2,strip-w16-c2-t2,strip-w16-c1-t2-s,strip-w16-c2-t2-s >> "$OUT/s55a_probe.log" 2>&1
           echo "s55a probe M=16 rc=$?"; python3 benchmarks/strip_pick.py "$OUT/s55a_probe.log";;
    s57a)  # PREPARED in session 56 (not yet run): small layers at M = 1 / 8 / 16 with the 8-warp ring form in clusters
           # of 2 ((8, 2, 1, 1) / (8, 2, 2, 1), A/B module): two CTAs per SM fit, so a call's CTAs can be resident beside
           # the previous call's and copy their whole share of the weights (4096^2: 16 rows per warp = the ring) before
           # griddepcontrol.wait; session 56's trace (H100) put 4096^2 M = 1 at 6.4 us against the floor probe's 3.0. Then
           # the strip kernel's trace with it (strip_probe w8-c2-s) and the 7B decode on the route
           SH=${S57A_SHAPES:-4096x4096,4096x1024,2048x2048,2048x8192,8192x2048,4096x8192,8192x4096,11008x4096}
           timeout ${S57A_T1:-150} python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 1,8,16 --shapes $SH \
             --configs route,strip-w8-c2-s,strip-w8-c2,strip-w16-c2,strip-w16-c2-s > "$OUT/s57a.log" 2>&1
           echo "s57a probe rc=$?"; python3 benchmarks/strip_pick.py "$OUT/s57a.log"
           nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -DJM_STRIP_TRACE -I cuda_src benchmarks/strip_probe.cu \
             -o /tmp/strip_probe && timeout 60 /tmp/strip_probe 2>&1 | grep -E "M=1 .*(w8-c2|w16-c2)" | tee "$OUT/s57a_trace.log";;
    s56a)  # session 56: where the routed strip forms' time goes, and what an L2 lead does (plain CUDA, no torch): the floor
           # probe (a bare stream at each occupancy, with / without bulk L2 prefetches 1-2 batches ahead) and the strip
           # kernel's trace with the route's cluster forms (w16-c2, w8-c2, w16-c2-t2). (Session 56 ran it with the strip
           # kernel built with an L2 lead of 0 / 1 / 2 batches, JM_STRIP_L2_AHEAD; the lead lost and left the kernel.)
           nvcc -std=c++17 -O3 -arch=sm_90a -I cuda_src benchmarks/floor_probe.cu -o /tmp/floor_probe &
           nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -DJM_STRIP_TRACE -I cuda_src \
             benchmarks/strip_probe.cu -o /tmp/strip_probe &
           wait
           timeout ${S56A_T1:-60} /tmp/floor_probe > "$OUT/s56a_floor.log" 2>&1; echo "s56a floor rc=$?"
           grep -E "^copy|8192x8192|11008x4096|4096x28672|8192x28672" "$OUT/s56a_floor.log" | grep -E "^copy|pdl 1"
           timeout ${S56A_T2:-60} /tmp/strip_probe > "$OUT/s56a_trace.log" 2>&1; echo "s56a trace rc=$?"
           cat "$OUT/s56a_trace.log";;
    s56b)  # PREPARED in session 56 (not yet run): the wgmma producer form's L2 lead (-DJM_WG_L2_AHEAD, stages of 64 k:
           # bulk prefetches of the weights ahead of the ring's copies) off and on, same kernels rebuilt through
           # JITMARLIN_NVCC_FLAGS, on the route at M = 16 / 32 / 64 (M = 17-64 on the large shapes is that form)
           SH=${S56B_SHAPES:-8192x8192,14336x4096,28672x8192,4096x28672,8192x28672}
           for f in "" "${S56B_FLAGS:--DJM_WG_L2_AHEAD=6}"; do
             echo "== flags [$f]" >> "$OUT/s56b.log"
             JITMARLIN_NVCC_FLAGS="$f" timeout ${S56B_T:-150} python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 \
               --m ${S56B_M:-16,32,64} --shapes $SH --configs route >> "$OUT/s56b.log" 2>&1
             echo "s56b [$f] rc=$?"
           done
           grep -E "^==| us " "$OUT/s56b.log" | sed -E 's/^\[[^]]*\] //; s/ \(floor.*//';;
    s55b)  # session 55: the strip kernel's tall-layer route (gemm.STRIP_TALL) and the MoE strip form's default rule
           # (moe.STRIP_MOE_MAX_BLOCKS): their GPU tests, then the route against itself without the tall rule (routeL0)
           # on the nine shapes at M = 1 / 8 / 16, then act-order on tall layers with the strip act-order form off / on
           timeout ${S55B_T1:-60} python3 -m pytest -q -rs tests/gpu/test_moe_gpu.py tests/gpu/test_strip_gpu.py \
             -k "few_blocks or route_and_fast_path" > "$OUT/s55b_tests.log" 2>&1
           echo "s55b tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/s55b_tests.log" | head; tail -2 "$OUT/s55b_tests.log"
           SH=${S55B_SHAPES:-4096x4096,8192x8192,14336x4096,4096x12288,11008x4096,4096x11008,4096x28672,28672x8192,8192x28672}
           timeout ${S55B_T2:-75} python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 1,8,16 --shapes $SH \
             --configs route,routeL0 > "$OUT/s55b_route.log" 2>&1
           echo "s55b route rc=$?"; grep -E " us " "$OUT/s55b_route.log" | sed -E 's/^\[[^]]*\] //; s/ \(floor.*//'
           for tp in 0 1; do
             timeout ${S55B_T3:-40} python3 benchmarks/probe_act_order.py --m 1,8 --shapes 11008x4096,8192x8192,28672x8192 \
               --strip-tall-perm $tp 2>&1 | grep -v "^done" | tee -a "$OUT/s55b_actorder.log"
           done;;
    s54g)  # PREPARED in session 54 (run on branch s54-strip before merging it): the mma.sync tiles' epilogue now loads
           # bias and MoE routing weights ahead of its stores, so the GEMM tests with a bias and the MoE GEMM tests first
           # (gemm: every tile at M = 1 with a bias; MoE: routing weights), then the rest of the gemm and formats files
           timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -rs --maxfail=20 -k "bias or moe or topk" \
             tests/gpu/test_gemm_gpu.py tests/gpu/test_moe_gpu.py tests/gpu/test_linear_gpu.py > "$OUT/s54g_tests.log" 2>&1
           echo "s54g tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/s54g_tests.log" | head -20; tail -3 "$OUT/s54g_tests.log";;
    s53b)  timeout ${TESTS_TIMEOUT:-500} python3 -m pytest -q -rs --maxfail=40 tests/gpu/test_wgmma_gpu.py > "$OUT/s53b_tests.log" 2>&1
           echo "s53b tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/s53b_tests.log" | head -20; tail -3 "$OUT/s53b_tests.log";;
    s53c)  # PREPARED in session 52: act-order on the strip route's small shapes at M = 1-8: the strip kernel's in-kernel
           # gather (M = 1, routed), the gather kernel + the usual route (M = 2-8, routed), the gather kernel + the strip
           # kernel's plain form (gemm.STRIP_GATHER_PLAIN, off); then the 7B decode on the new route (its 4096^2
           # projection at M = 1 takes the strip kernel) and the MoE strip form (s50d)
           for g in 0 1; do
             timeout 90 python3 benchmarks/probe_act_order.py --m 1,2,4,8 --shapes 4096x4096,2048x2048,4096x1024,8192x2048 \
               --strip-gather-plain $g 2>&1 | grep -v "^done" | tee -a "$OUT/s53c_actorder.log"
           done
           timeout 200 python3 benchmarks/bench_e2e.py --models llama --variants fp16,w4-fused --batches 1,8 --prefill 128 \
             --decode 128 > "$OUT/s53c_e2e.log" 2>&1
           echo "s53c e2e rc=$?"; grep -E "^\|" "$OUT/s53c_e2e.log" | tail -6;;
    s52b)  # session 52: the GPU test files s52a's run did not reach (it stopped at 400 s inside test_linear_gpu.py; the
           # wgmma file is left for a later call), on the strip kernel's small-shape route (gemm.strip_small) with its
           # shared-memory ring from K = 8192; then that rule's one new cell (8192x2048) and bench_gemm's 4096^2 rows
           # S52B_FILES: the test files, in order (default: all six)
           F=${S52B_FILES:-"strip linear model tuning moe moe_util"}
           timeout ${TESTS_TIMEOUT:-330} python3 -m pytest -q -rs --maxfail=40 $(for f in $F; do echo tests/gpu/test_${f}_gpu.py; done) \
             > "$OUT/s52b_tests.log" 2>&1
           echo "s52b tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/s52b_tests.log" | head -20; tail -3 "$OUT/s52b_tests.log"
           timeout 60 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 1,4,8 --shapes 8192x2048,4096x1024 \
             --configs routeS0,route,strip-w16-c2,strip-w16-c2-s > "$OUT/s52b.log" 2>&1
           echo "s52b probe rc=$?"; python3 benchmarks/strip_pick.py "$OUT/s52b.log"
           for sw in 0 1; do  # act-order on the small shapes: gather + route (0) vs the strip kernel's in-kernel gather (1)
             timeout 60 python3 benchmarks/probe_act_order.py --m 1,8 --shapes 4096x4096,2048x2048,4096x1024 \
               --strip-small $sw 2>&1 | grep -v "^done" | tee -a "$OUT/s52b_actorder.log"
           done
           timeout 120 python3 benchmarks/bench_gemm.py --json "$OUT/s52b_gemm.json" --shapes 4096x4096 --m 1,16 \
             --variants none > "$OUT/s52b_gemm.log" 2>&1
           echo "s52b bench rc=$?"; grep -E "^\|" "$OUT/s52b_gemm.log" | tail -8;;
    s52a)  # session 52: s50a's probe (strip kernel vs the route on nine shapes) lost on every shape but 4096^2 (M <= 8:
           # 0.78-0.85x) and near even on 11008x4096; here the small shapes (K*N <= 2^24) it may win on, f16 then bf16 and
           # 8-bit spot checks, then the GPU suite but the wgmma file (strip tests first: s50a's run stopped at a test bug)
           SH=1024x1024,2048x2048,4096x1024,1024x4096,4096x2048,2048x4096,8192x2048,2048x8192,4096x4096,14336x1024,5120x2048
           timeout 150 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 1,4,8,16 --shapes $SH \
             --configs routeS0,route,routeS,strip-w16-c1,strip-w16-c2,strip-w16-c4,strip-w8-c1,strip-w8-c2,strip-w16-c2-s,strip-w8-c1-s \
             > "$OUT/s52a.log" 2>&1
           echo "s52a probe f16 rc=$?"
           for v in "--dtype bf16" "--dtype f16 --bits 8"; do
             timeout 60 python3 benchmarks/probe_configs.py $v --settle 0.1 --m 1,8 --shapes 2048x2048,4096x4096,4096x1024 \
               --configs routeS0,route,routeS >> "$OUT/s52a.log" 2>&1
             echo "s52a probe [$v] rc=$?"
           done
           python3 benchmarks/strip_pick.py "$OUT/s52a.log"
           timeout ${TESTS_TIMEOUT:-440} python3 -m pytest -q -rs --maxfail=40 tests/gpu/test_strip_gpu.py tests/gpu \
             --ignore=tests/gpu/test_wgmma_gpu.py > "$OUT/s52a_tests.log" 2>&1
           echo "s52a tests rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/s52a_tests.log" | head -20; tail -3 "$OUT/s52a_tests.log";;
    s50a)  # PREPARED in session 49 (its one GPU run, s49e0, had the weights addressed in the wrong order; fixed, CPU
           # mirror test tests/test_strip_mirror.py; no device after): the strip kernel (cuda_src/jm_strip.cuh, M <= 16,
           # no global partial sums): its GPU tests, then every built (warps, cluster, token blocks, ring) config and routeS
           # (gemm.STRIP_ROUTE on) against the route at M = 1 / 4 / 8 (one block) and 12 / 16 (two) on the bench shapes
           # and the 7B's; the route goes on only where routeS wins
           timeout 240 python3 -m pytest -q -rs -x tests/gpu/test_strip_gpu.py > "$OUT/s50a_test.log" 2>&1
           echo "s50a tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|Error" "$OUT/s50a_test.log" | tail -12
           SH=4096x4096,8192x8192,14336x4096,4096x12288,11008x4096,4096x11008,4096x28672,28672x8192,8192x28672
           timeout 200 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 1,4,8 --shapes $SH \
             --configs route,routeS,strip-w16-c1,strip-w16-c2,strip-w16-c4,strip-w8-c1,strip-w8-c2,strip-w4-c1,strip-w16-c1-s,strip-w16-c2-s,strip-w8-c1-s,strip-w4-c1-s \
             > "$OUT/s50a.log" 2>&1
           echo "s50a probe 1-8 rc=$?"
           timeout 150 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 12,16 --shapes $SH \
             --configs route,routeS,strip-w16-c1-t2,strip-w16-c2-t2,strip-w8-c1-t2,strip-w8-c2-t2,strip-w4-c1-t2,strip-w16-c1-t2-s,strip-w16-c2-t2-s,strip-w4-c1-t2-s \
             >> "$OUT/s50a.log" 2>&1
           echo "s50a probe 12-16 rc=$?"; python3 benchmarks/strip_pick.py "$OUT/s50a.log";;
    s50b)  # PREPARED in session 49: the 7B decode with the strip route on (JITMARLIN_STRIP=1) and off, same run: its
           # GEMMs are 4096x12288 / 4096^2 / 4096x22016 / 11008x4096 at M = 1 / 8 (fused projections), all mid-size
           for sw in 0 1; do
             JITMARLIN_STRIP=$sw timeout 200 python3 benchmarks/bench_e2e.py --models llama --variants fp16,w4-fused \
               --batches 1,8 --prefill 128 --decode 128 > "$OUT/s50b_strip$sw.log" 2>&1
             echo "s50b strip=$sw rc=$?"; grep -E "^\|" "$OUT/s50b_strip$sw.log" | tail -6
           done;;
    s50d)  # PREPARED in session 50 (no device lent): the MoE layer with the strip route on and off (its MoE form: a CTA
           # per (block of 8, strip), moe.strip_moe_config): #7's Mixtral 1-token row is 63.1 us, 1.44x the W4 floor,
           # E=64 16 / 64 tokens 1.41 / 1.48x (target <= 1.3x); first its GPU tests
           timeout 150 python3 -m pytest -q -rs -x tests/gpu/test_moe_gpu.py -k strip_kernel > "$OUT/s50d_test.log" 2>&1
           echo "s50d test rc=$?"; tail -3 "$OUT/s50d_test.log"
           for sw in 0 1; do  # (blocks of 8: one token, and E=64's small experts at 16 / 64 tokens)
             JITMARLIN_STRIP=$sw timeout 150 python3 benchmarks/bench_moe.py --tokens 1,16,64 --json "$OUT/s50d_strip$sw.json" \
               > "$OUT/s50d_strip$sw.log" 2>&1
             echo "s50d strip=$sw rc=$?"; grep -E "^\|" "$OUT/s50d_strip$sw.log" | tail -4
           done;;
    s50e)  # PREPARED in session 50 (no device lent): the strip kernel's three / four token blocks (M = 17-32, at most 8
           # warps per SM, shared-memory ring) against the route (the wgmma 32-token tile) at M = 17 / 24 / 32: #7's
           # M = 32 target is 2.8x fp16 on the large shapes (8192x28672 <= 40 us; now 52.8)
           SH=4096x28672,14336x4096,8192x8192,8192x28672,28672x8192,4096x4096
           timeout 300 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 17,24,32 --shapes $SH \
             --configs route,routeS,strip-w8-c1-t3-s,strip-w4-c1-t3-s,strip-w8-c1-t4-s,strip-w8-c2-t4-s,strip-w4-c1-t4-s,strip-w8-c1-t4 \
             > "$OUT/s50e.log" 2>&1
           echo "s50e probe rc=$?"; python3 benchmarks/strip_pick.py "$OUT/s50e.log";;
    s50c)  # PREPARED in session 50 (no device lent): act-order at M = 1 / 16 with the strip route on and off: the gather
           # runs first and the strip kernel, a programmatic dependent, streams its first weight rows before waiting for
           # it; if that leaves the gather's time exposed, fusing the column gather into the strip kernel's activation
           # loads is the next step (#4: act-order within 10% at M <= 16)
           for sw in 0 1; do
             JITMARLIN_STRIP=$sw timeout 120 python3 benchmarks/probe_act_order.py --m 1,16 \
               --shapes 4096x4096,14336x4096,8192x8192,4096x28672,28672x8192 > "$OUT/s50c_strip$sw.log" 2>&1
             echo "s50c strip=$sw rc=$?"; tail -14 "$OUT/s50c_strip$sw.log"
           done;;
    s49a)  # PREPARED in session 48 (not run): bench_gemm with the peers at M = 300 / 416 / 544 on session 48's route
           # (s47e ran M = 300 / 544 on session 47's: Humming faster in 10 of 12 cells); then why the 176-token tile lost
           # to the 192-token one with three K splits through the workspace (s48f: 5120^2 M = 150 / 176 +9%): both
           # tiles with one / two (clustered) / three / four splits and stream-K on 5120^2 and 13824x5120, one round
           timeout ${S49A_BENCH_TIMEOUT:-300} python3 benchmarks/bench_gemm.py --m 300,416,544 --variants none --settle 0.2 \
             --json "$OUT/s49a_gemm.json" > "$OUT/s49a_gemm.log" 2>&1
           echo "s49a bench rc=$?"; tail -30 "$OUT/s49a_gemm.log"
           cf=; for t in n176-f1-s6 n192-f1-s6; do for sp in k1 k2 k3 k4 sk; do cf=$cf${cf:+,}wgmma-$t-$sp-p2; done; done
           timeout 90 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 150,176 --configs route,$cf \
             --shapes 5120x5120,13824x5120 > "$OUT/s49a.log" 2>&1
           echo "s49a probe rc=$?"; grep -c " us" "$OUT/s49a.log"; grep -ci "err nan\|failed" "$OUT/s49a.log";;
    s49b)  # PREPARED in session 48 (not run): the cost model with its fix-up terms scaled by the tile's rows (probe
           # routeC49, gemm.WGMMA_COST_FIXUP_ROWS; fit_tall_cost.py ... --route48 s48d.log --fixup-rows) against the
           # shipped one, two interleaved rounds, on shapes where 39 of 252 CPU-checked cells differ (among them s48d's
           # slower cells: 3584x4608 M = 300 / 352, 2048x2560 M = 448-544, 13824x5120 M = 300 go back to session 47's
           # launches); adopt only if it wins there (gemm.WGMMA_COST_* take S49_FIT_*, WGMMA_COST_FIXUP_ROWS = True)
           for r in 1 2; do
             timeout 90 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 257,300,352,416,448 --configs route,routeC49 \
               --shapes 13824x5120,5120x5120,3584x4608,4096x28672,4096x22016,3584x37888,18944x3584,2048x2560,3584x3584,8192x2048 \
               >> "$OUT/s49b.log" 2>&1
             timeout 150 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 528,544,624,704,800,960,1024 --configs route,routeC49 \
               --shapes 14336x4096,28672x8192,11008x4096,5120x13824,5120x5120,3584x37888,18944x3584,2048x2560,4096x12288,4096x11008,2048x2048,8192x2048 \
               >> "$OUT/s49b.log" 2>&1
             echo "s49b $r rc=$?"
           done
           grep -c " us" "$OUT/s49b.log"; grep -ci "err nan\|failed" "$OUT/s49b.log";;
    s48g)  # session 48, the final route (the 208- / 224- / 240-token rows, fill 0.6 / 0.7, the refit cost model; kernels
           # as in s48f's test run): the route-dependent tests of test_wgmma_gpu.py, then the GEMM, formats and linear files
           timeout ${S48G_TEST_TIMEOUT:-150} python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py -k "tall or cluster or halve" \
             > "$OUT/s48g_test.log" 2>&1
           echo "s48g wgmma rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s48g_test.log" | tail -8
           timeout ${S48G_TESTS_TIMEOUT:-330} python3 -m pytest -q -rs tests/gpu/test_gemm_gpu.py tests/gpu/test_formats_gpu.py \
             tests/gpu/test_linear_gpu.py > "$OUT/s48g_tests.log" 2>&1
           echo "s48g tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s48g_tests.log" | tail -8;;
    s48h)  # session 48, the final route: test_tall_token_tile_route again (s48g: its last assertion, the set of tiles
           # seen, did not know the model-only 176-token tile), the model, MoE, MoE-util and tuning GPU tests, then
           # bench_gemm at M = 300 / 544 with the peers (session 47's s47e ran the same before the session's changes)
           timeout 90 python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py -k "tall_token_tile_route" > "$OUT/s48h_test.log" 2>&1
           echo "s48h wgmma rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s48h_test.log" | tail -8
           timeout ${S48H_TESTS_TIMEOUT:-260} python3 -m pytest -q -rs tests/gpu/test_model_gpu.py tests/gpu/test_moe_gpu.py \
             tests/gpu/test_moe_util_gpu.py tests/gpu/test_tuning_gpu.py > "$OUT/s48h_tests.log" 2>&1
           echo "s48h tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s48h_tests.log" | tail -8
           timeout ${S48H_BENCH_TIMEOUT:-150} python3 benchmarks/bench_gemm.py --m 300,544 --variants none --settle 0.2 \
             --json "$OUT/s48h_gemm.json" > "$OUT/s48h_gemm.log" 2>&1
           echo "s48h bench rc=$?"; tail -30 "$OUT/s48h_gemm.log";;
    s48f)  # session 48: the table's new rows at M = 145-256 (176 / 208 / 224 / 240 tokens where 192 / 256 ran; old rows:
           # routeR47; the 176-token row lost on N = 5120 here and was dropped after, so M = 150 / 176 now match) and the
           # halving rule at 0.6 x SMs (old: routeHF8; 0.7 for the 64-token tile after) on shapes s48e did not measure, f16 two
           # interleaved rounds, then bf16 and fp16 8-bit one round; then test_wgmma_gpu.py on the new route
           for r in 1 2; do
             timeout 70 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 150,176,200,224,240 --configs routeR47,route \
               --shapes 11008x4096,5120x13824,13824x5120,4096x22016,18944x3584,3584x37888,2048x11008,5120x5120,4096x6144 >> "$OUT/s48f.log" 2>&1
             timeout 40 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 64,96,128 --configs routeHF8,route \
               --shapes 6144x6144,8192x6144,3072x5120,4096x5120,3072x6144 >> "$OUT/s48f.log" 2>&1
             timeout 40 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --m 160,200,256 --configs routeHF8,route \
               --shapes 4096x2560,6144x3072,3072x2560,5120x2560 >> "$OUT/s48f.log" 2>&1
             echo "s48f $r rc=$?"
           done
           for dt in "--dtype bf16" "--dtype f16 --bits 8"; do
             timeout 40 python3 benchmarks/probe_configs.py $dt --settle 0.1 --m 176,208,224,240 --configs routeR47,route \
               --shapes 4096x12288,8192x8192,14336x4096 >> "$OUT/s48f.log" 2>&1
             timeout 40 python3 benchmarks/probe_configs.py $dt --settle 0.1 --m 128,224,256 --configs routeHF8,route \
               --shapes 3072x3072,4096x6144,5120x5120,4096x3072 >> "$OUT/s48f.log" 2>&1
           done
           grep -c " us" "$OUT/s48f.log"; grep -ci "err nan\|failed" "$OUT/s48f.log"
           timeout ${S48F_TEST_TIMEOUT:-300} python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py > "$OUT/s48f_test.log" 2>&1
           echo "s48f test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s48f_test.log" | tail -12;;
    s48a|s48b)  # session 48 (prepared in session 47; the tiles are built by default since, --extra-wgmma then): token tiles of 176 / 208 / 224 / 240 rows (jm_wgmma.cuh, built only with
           # --extra-wgmma), which pad M = 257-1024 less than 144 / 160 / 192 / 256 (M = 352 = 2 x 176, 448 = 2 x 224, 528 =
           # 3 x 176, 624 = 3 x 208, 704 = 4 x 176, 960 = 4 x 240; 300 / 416 / 800 / 1024 for the fit): first their GPU
           # test (s48a), then every tall tile whole (automatic K splits) and stream-K (-sk), the route and the route
           # without tall tiles (routeT0: the plain forms the model prices too), data for fit_tall_cost.py --extra-tiles
           # 176-1-6,208-1-6,224-1-5,240-1-5 --clustered s48a.log --clustered s48b.log. s48a: four shapes, s48b: the two
           # largest (28672 x 8192, 8192 x 28672). Look for "err nan" / "failed" first (outputs are NaN-poisoned).
           ex=176-1-6-p2,208-1-6-p2,224-1-5-p2,240-1-5-p2
           cf=route,routeT0; for t in n144-f1-s6 n160-f2-s4 n176-f1-s6 n192-f1-s6 n208-f1-s6 n224-f1-s5 n240-f1-s5 n256-f1-s4; do
             cf=$cf,wgmma-$t-p2,wgmma-$t-sk-p2; done
           if [ "$st" = s48a ]; then
             timeout 200 python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py -k "extra_tall" > "$OUT/s48a_test.log" 2>&1
             echo "s48a test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s48a_test.log" | tail -6
             shapes=4096x4096,8192x8192,14336x4096,4096x28672
           else
             shapes=28672x8192,8192x28672
           fi
           timeout ${S48_PROBE_TIMEOUT:-380} python3 benchmarks/probe_configs.py --dtype f16 --settle 0.1 --extra-wgmma $ex \
             --m 300,352,416,448,528,624,704,800,960,1024 --configs $cf --shapes $shapes >> "$OUT/$st.log" 2>&1
           echo "$st probe rc=$?"; grep -c " us" "$OUT/$st.log"; grep -ci "err nan\|failed" "$OUT/$st.log";;
    s47f)  # session 47: the (144, 1, 6) row at M = 145-192 on N <= 2560 (s47e's routeM129 launches there): the tall-tile
           # GPU tests on it, then one probe round against the 192-token tile forced with the old row's splits
           timeout ${S47F_TEST_TIMEOUT:-200} python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py -k "tall" > "$OUT/s47f_test.log" 2>&1
           echo "s47f test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s47f_test.log" | tail -6
           timeout 30 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 --m 160,192 --configs route,wgmma-n192-f1-s6-k2-p2 \
             --shapes 2048x2048,2048x2560 >> "$OUT/s47f.log" 2>&1
           timeout 30 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 --m 160,192 --configs route,wgmma-n192-f1-s6-k4-p2 \
             --shapes 5632x2048,8192x2048 >> "$OUT/s47f.log" 2>&1
           echo "s47f probe rc=$?"; grep -c " us" "$OUT/s47f.log";;
    s47e)  # session 47: the cost model's tall tile from M = 129 (probe routeM129) against the table's rows (route) on
           # cells where they differ (small shapes: the 144-token tile instead of the 192-token one / the 128-token
           # tile; large ones: (160, 2) stream-K instead of the 144-token tile's splits), two rounds; bench_gemm at
           # M = 300 / 544 with the peers (README Status); then the GEMM, formats and linear GPU tests on the new route
           for r in 1 2; do
             timeout 60 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 --m 160,192,224,256 --configs route,routeM129 \
               --shapes 2048x2048,2048x2560,5632x2048,8192x2048,3584x3584 >> "$OUT/s47e.log" 2>&1
             timeout 60 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 --m 129,160 --configs route,routeM129 \
               --shapes 11008x4096,14336x4096,13824x5120,8192x10240,18944x3584,4096x28672,28672x8192 >> "$OUT/s47e.log" 2>&1
             echo "s47e $r rc=$?"
           done
           grep -c " us" "$OUT/s47e.log"; grep -i "failed\|error" "$OUT/s47e.log" | head -5
           timeout 150 python3 benchmarks/bench_gemm.py --m 300,544 --variants none --settle 0.2 --json "$OUT/s47e_gemm.json" \
             > "$OUT/s47e_gemm.log" 2>&1
           echo "s47e bench rc=$?"; grep -E "^\| [0-9]" "$OUT/s47e_gemm.log" | head -40
           timeout ${S47E_TEST_TIMEOUT:-300} python3 -m pytest -q -rs tests/gpu/test_gemm_gpu.py tests/gpu/test_formats_gpu.py \
             tests/gpu/test_linear_gpu.py > "$OUT/s47e_test.log" 2>&1
           echo "s47e test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s47e_test.log" | tail -6;;
    s47d)  # session 47: the refitted cost model (shipped: session 46's fit with the 144-token tile and the cluster
           # term) against session 44's (routeC0) on cells outside the fit where their picks differ (small N / K shapes:
           # 2048x2048 / 2048x2560 the 144-token tile, 3584 / 5632 / 8192x2048 / 37888 / 22016 others), two rounds;
           # then test_wgmma_gpu.py on the new route (TALL_CASES updated to the refit's picks)
           for r in 1 2; do
             timeout 60 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 --m 257,300,384,448,512,640,768,896,1024 \
               --configs route,routeC0 --shapes 2048x2560,2048x2048 >> "$OUT/s47d.log" 2>&1
             timeout 60 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 --m 257,448,640 --configs route,routeC0 \
               --shapes 3584x3584,5632x2048,8192x2048 >> "$OUT/s47d.log" 2>&1
             timeout 60 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 --m 384,640,896 --configs route,routeC0 \
               --shapes 4096x22016,3584x37888,18944x3584 >> "$OUT/s47d.log" 2>&1
             echo "s47d $r rc=$?"
           done
           grep -c " us" "$OUT/s47d.log"; grep -i "failed\|error" "$OUT/s47d.log" | head -5
           timeout ${S47D_TEST_TIMEOUT:-260} python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py > "$OUT/s47d_test.log" 2>&1
           echo "s47d test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s47d_test.log" | tail -6;;
    s47c)  # session 47 (run as "s47c s47b"): test_wgmma_gpu.py on the route with WGMMA_HALVE_OVER_TALL on (s47a's
           # data, K bounds 4096 / 8192 under the 192- / 256-token tiles), then the halving rule past those bounds
           # (routeHTK) against the route at M = 200-256 on N = 4096 with K = 9216-14336 (where the route runs the
           # 256-token tile's four splits), two rounds, and the new route against routeHT0 once on s47a's shapes
           timeout ${S47C_TEST_TIMEOUT:-240} python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py > "$OUT/s47c_test.log" 2>&1
           echo "s47c test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s47c_test.log" | tail -6
           for r in 1 2; do
             timeout 60 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 --m 200,224,256 --configs route,routeHTK \
               --shapes 9216x4096,11008x4096,12288x4096,14336x4096 >> "$OUT/s47c.log" 2>&1
             echo "s47c htk $r rc=$?"
           done
           timeout 60 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 --m 160,192,224,256 --configs route,routeHT0 \
             --shapes 3072x4096,5120x4096,8192x4096 >> "$OUT/s47c.log" 2>&1
           echo "s47c ht0 rc=$?"; grep -c " us" "$OUT/s47c.log";;
    s47b)  # session 47 (ran as written then, with configs route,routeCL; since the refit shipped, the same launches are
           # routeC0,route): the cost model above M = 256 refitted with the clustered two-way split's
           # term and the 144-token tile (then probe config routeCL, probe_configs.S46_FIT_*) against the shipped model
           # (route), two interleaved rounds, on the cells where its pick differs (11 of 135 checked on the CPU: 144-token
           # tiles at M = 257 on N = 4096 / 6144, 3584x4608 M = 257 / 300 on the 128-token tile's two clustered splits,
           # 5120x5120 M = 448 / 1024, 28672x8192 / 5120x13824 M = 544) and their neighbours. Adopt the refit only if it
           # wins there (then gemm.WGMMA_COST_PER_STAGE / _TERMS take S46_FIT_*, and the GPU tests of the route)
           for r in 1 2; do
             timeout 90 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 --m 257,300,448,544,1024 --configs routeC0,route \
               --shapes 4096x4096,14336x4096,11008x4096,5120x13824,28672x8192,5120x5120,3584x4608,4096x6144 >> "$OUT/s47b.log" 2>&1
             echo "s47b $r rc=$?"
           done
           grep -c " us" "$OUT/s47b.log"; grep -i "failed\|error" "$OUT/s47b.log" | head -5;;
    s47a)  # session 47 (ran with configs route,routeHT; since the rule shipped, the same launches are routeHT0,route
           # up to its K bounds): first the GPU tests session 46 left (test_cluster_sum's new op check of the
           # 64-token halved route; the model / MoE / MoE-utility / tuning files on session 46's route), then the
           # prepared gemm.WGMMA_HALVE_OVER_TALL (probe `routeHT`): the plain 128-token tile's two clustered splits
           # instead of the table's 192- / 256-token tile at M = 145-256 on N = 4096, K = 3072-8192 (the K bound is to
           # be set from this), f16 two rounds and bf16 once. Flip the flag only with the data, then test_wgmma_gpu.py
           timeout 120 python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py -k "cluster_sum" > "$OUT/s47a_test.log" 2>&1
           echo "s47a test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s47a_test.log" | tail -6
           timeout ${S47A_TESTS_TIMEOUT:-240} python3 -m pytest -q -rs tests/gpu/test_model_gpu.py tests/gpu/test_moe_gpu.py \
             tests/gpu/test_moe_util_gpu.py tests/gpu/test_tuning_gpu.py > "$OUT/s47a_tests2.log" 2>&1
           echo "s47a tests2 rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s47a_tests2.log" | tail -6
           for r in 1 2; do
             timeout 60 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 --m 145,160,192,224,256 --configs routeHT0,route \
               --shapes 3072x4096,4096x4096,5120x4096,6144x4096,8192x4096 >> "$OUT/s47a.log" 2>&1
             echo "s47a f16 $r rc=$?"
           done
           timeout 40 python3 benchmarks/probe_configs.py --dtype bf16 --settle 0.2 --m 160,192,256 --configs routeHT0,route \
             --shapes 3072x4096,4096x4096,8192x4096 >> "$OUT/s47a.log" 2>&1
           echo "s47a bf16 rc=$?"; grep -c " us" "$OUT/s47a.log";;
    s46h)  # session 46: the halving rule on the 64-token tile (K <= 4096): route vs routeH0 at M = 40 / 64 in three
           # formats, then the cluster / split GPU tests on it
           for v in "--dtype f16" "--dtype bf16" "--dtype f16 --bits 8"; do
             timeout 40 python3 benchmarks/probe_configs.py $v --settle 0.2 --m 40,64 --configs route,routeH0,route,routeH0 \
               --shapes 3072x8192,4096x8192,5120x8192 >> "$OUT/s46h.log" 2>&1
             echo "s46h $v rc=$?"
           done
           timeout ${S46H_TEST_TIMEOUT:-110} python3 -m pytest -q -x -rs tests/gpu/test_wgmma_gpu.py -k "cluster_sum or k_splits" \
             > "$OUT/s46h_test.log" 2>&1
           echo "s46h test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s46h_test.log" | tail -6;;
    s46g)  # session 46: the halving idea at M = 33-64 (the plain 64-token tile's four splits at two CTAs per SM on
           # N = 8192, 64 tiles: two clustered splits of it, or of the 128-token tile) and at M = 160-192 on N = 4096
           # (the table's tall tile vs the 128-token tile's two clustered splits), two interleaved rounds
           for r in 1 2; do
             timeout 50 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 --m 40,64 \
               --configs route,wgmma-n64-f1-s6-k2,wgmma-n128-f1-s4-k2 --shapes 4096x8192,8192x8192,3072x8192,5120x8192 \
               >> "$OUT/s46g.log" 2>&1
             echo "s46g a $r rc=$?"
             timeout 40 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 --m 160,176,192 \
               --configs route,wgmma-n128-f1-s4-k2 --shapes 4096x4096,3072x4096 >> "$OUT/s46g.log" 2>&1
             echo "s46g b $r rc=$?"
           done
           grep -c " us" "$OUT/s46g.log"; grep -i "failed\|error" "$OUT/s46g.log" | head -5;;
    s46f)  # session 46: #3's 8192^2 M = 16 cell (route: the (16, 1, 8) producer form, four K splits through the
           # workspace at two CTAs per SM) and M = 24-32 ((32, 1, 6) producer form, six splits at three per SM) with two
           # clustered splits instead (one CTA per SM, as the plain 128-token halving rule), producer and plain forms,
           # two interleaved rounds; bf16 once
           for r in 1 2; do
             timeout 60 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 --m 9,16,24,32 \
               --configs route,wgmma-n16-f1-s8-k2-p,wgmma-n16-f1-s8-k2,wgmma-n32-f1-s6-k2-p,wgmma-n32-f1-s8-k2,wgmma-n16-f1-s8-k4-p \
               --shapes 8192x8192 >> "$OUT/s46f.log" 2>&1
             echo "s46f $r rc=$?"
           done
           timeout 60 python3 benchmarks/probe_configs.py --dtype bf16 --settle 0.2 --m 9,16,24,32 \
             --configs route,wgmma-n16-f1-s8-k2-p,wgmma-n16-f1-s8-k2,wgmma-n16-f1-s8-k4-p,wgmma-n32-f1-s6-k2-p \
             --shapes 8192x8192 >> "$OUT/s46f.log" 2>&1
           echo "s46f bf16 rc=$?"; grep -c " us" "$OUT/s46f.log"; grep -i "failed\|error" "$OUT/s46f.log" | head -5;;
    s46d)  # session 46: the halving rule (two clustered K splits for the plain 128-token tile, K <= 8192) on bf16 and
           # 8-bit weights, route vs routeH0, two rounds; bench_gemm at M = 64 / 256 (README rows); then the GEMM,
           # formats and linear GPU tests (routes through the op)
           for v in "--dtype bf16" "--dtype f16 --bits 8" "--dtype bf16 --bits 8"; do
             timeout 60 python3 benchmarks/probe_configs.py $v --settle 0.2 --m 96,128,224,256 --configs route,routeH0,route,routeH0 \
               --shapes 4096x4096,3072x4096,4096x8192,8192x8192 >> "$OUT/s46d.log" 2>&1
             echo "s46d $v rc=$?"
           done
           grep -c " us" "$OUT/s46d.log"
           timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_gemm.py --json "$OUT/s46d_bench.json" --m 64,256 --variants none \
             > "$OUT/s46d_bench.log" 2>&1
           echo "s46d bench rc=$?"; grep -E "^\| [0-9]" "$OUT/s46d_bench.log" | head -40
           timeout ${S46D_TESTS_TIMEOUT:-250} python3 -m pytest -q -rs tests/gpu/test_gemm_gpu.py tests/gpu/test_formats_gpu.py \
             tests/gpu/test_linear_gpu.py > "$OUT/s46d_test.log" 2>&1
           echo "s46d test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s46d_test.log" | tail -12;;
    s46c)  # session 46: the plain 128-token tile's three / four K splits as two clustered ones where two per tile give
           # every SM one CTA (gemm.wgmma_halve_splits): route vs routeH0 (the rule off), two interleaved rounds, on
           # the cells it changes (N = 8192 at M = 65-128, N = 4096 at M = 193-256) and unchanged neighbours; then
           # the wgmma GPU tests
           for r in 1 2; do
             timeout 80 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 --m ${S46C_M:-72,96,128,200,224,256} \
               --configs route,routeH0 --shapes ${S46C_SHAPES:-4096x4096,3072x4096,4096x8192,8192x8192,3072x8192,14336x8192,28672x8192,11008x8192} \
               >> "$OUT/s46c.log" 2>&1
             echo "s46c probe $r rc=$?"
           done
           grep -c " us" "$OUT/s46c.log"
           timeout ${S46C_TEST_TIMEOUT:-300} python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py > "$OUT/s46c_test.log" 2>&1
           echo "s46c test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s46c_test.log" | tail -12;;
    s46b)  # session 46 (ran; DROPPED, the code is benchmarks/prepared/s46b_cluster_pairs.patch plus a -DJM_WG_NO_PAIRS
           # guard around its pair block): four or more K splits in clusters of 2, the pairs' shares summed
           # through the workspace (gemm.WGMMA_CLUSTER_PAIRS, off): its GPU tests, then route vs route+pairs vs
           # route+ws on the cells where the route splits K in four or more, interleaved with the route built with
           # -DJM_WG_NO_PAIRS (the pair path compiled out = main's machine code, cubin md5) to price the small
           # spills the path adds to three kernels (8 B in the plain 32-token tile, 32 / 44 B in its producer form)
           timeout 200 python3 -m pytest -q -x -rs tests/gpu/test_wgmma_gpu.py -k "cluster_pairs or cluster_sum or k_splits" \
             > "$OUT/s46b_test.log" 2>&1
           echo "s46b test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|Error" "$OUT/s46b_test.log" | tail -8
           for r in 1 2; do
             timeout 110 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 --m 16,32,64,129,192,256,300 \
               --configs route,route+pairs,route+ws --shapes 4096x4096,14336x4096,11008x4096,8192x8192,4096x28672 \
               >> "$OUT/s46b.log" 2>&1
             echo "s46b probe $r rc=$?"
             JITMARLIN_NVCC_FLAGS=-DJM_WG_NO_PAIRS timeout 60 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 \
               --m 16,32,64,129,192,256,300 --configs route --shapes 4096x4096,14336x4096,11008x4096,8192x8192,4096x28672 \
               >> "$OUT/s46b_nopairs.log" 2>&1
             echo "s46b nopairs $r rc=$?"
           done
           grep -c " us" "$OUT/s46b.log" "$OUT/s46b_nopairs.log";;
    s46a)  # PREPARED in session 45 (not run): the data for pricing a K split in two as a cluster (session 45's cluster
           # sum) in the cost model and the table: the tall tiles and the 64- / 128-token plain tiles forced to two
           # splits (clustered where gemm.wgmma_cluster_sum takes it) and to one, the route, and the route with the
           # workspace (+ws), M = 129-544 on 8 shapes. Then extend benchmarks/fit_tall_cost.py with a cluster term
           # (its launches need the H200's max active clusters: s45g) and refit.
           timeout ${S46A_TIMEOUT:-300} python3 benchmarks/probe_configs.py --dtype f16 --settle 0.3 --m ${S46A_M:-129,160,192,256,300,384,544} \
             --configs route,route+ws,wgmma-n128-f1-s4-k2,wgmma-n144-f1-s6-k2-p2,wgmma-n192-f1-s6-k2-p2,wgmma-n256-f1-s4-k2-p2,wgmma-n160-f2-s4-k2-p2,wgmma-n192-f1-s6-k1-p2,wgmma-n256-f1-s4-k1-p2,route \
             --shapes ${S46A_SHAPES:-4096x4096,8192x8192,14336x4096,11008x4096,4096x12288,13824x5120,5120x13824,28672x8192} \
             > "$OUT/s46a.log" 2>&1
           echo "s46a rc=$?"; grep -c " us" "$OUT/s46a.log"; grep -i "failed\|error" "$OUT/s46a.log" | head -5;;
    s45h)  # session 45: the workspace fixup's region loads in batches (-DJM_WG_SUM_BATCH: 2-4 regions per round trip for
           # 16- and 32-token tiles) against one region per round trip, two interleaved rounds; then the split and
           # stream-K GPU tests on the flagged build
           for r in 1 2; do
             for f in "" -DJM_WG_SUM_BATCH; do
               JITMARLIN_NVCC_FLAGS="$f" timeout 60 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.2 \
                 --m 9,16,24,32,48,64 --configs route \
                 --shapes 4096x4096,8192x8192,4096x12288,4096x11008,11008x4096,8192x28672 >> "$OUT/s45h.log" 2>&1
               echo "s45h '$f' $r rc=$?"
             done
           done
           grep -c " us" "$OUT/s45h.log"
           JITMARLIN_NVCC_FLAGS=-DJM_WG_SUM_BATCH timeout ${S45H_TEST_TIMEOUT:-110} python3 -m pytest -q -x -rs tests/gpu/test_wgmma_gpu.py \
             -k "k_splits or stream_k or cluster_sum or moe_stream_k or moe_down_splits" > "$OUT/s45h_test.log" 2>&1
           echo "s45h test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s45h_test.log" | tail -6;;
    s45g)  # session 45: how many clusters of 2 / 3 / 4 the H200 runs at once for the routed K-split forms, and clusters
           # of 4 under the one-round rule (+c4) against 2 (route) and the workspace (+ws) where the route splits in four
           python3 - > "$OUT/s45g.log" 2>&1 <<'PY'
from jitmarlin.ops import _kernels as K, gemm as G
fam = K.Family("f16", 4, False, 128)
for (nt, fw, st, prod, thr) in ((16, 1, 8, 1, 256), (64, 1, 6, 0, 256), (128, 1, 4, 0, 256), (144, 1, 6, 2, 384),
                                (192, 1, 6, 2, 384), (256, 1, 4, 2, 384), (160, 2, 4, 2, 384)):
    fn = K.get_wgmma_kernel(fam, nt, fw, st, 0, False, prod)
    smem = K.wgmma_smem_bytes(fam, nt, fw, st)
    print("max_active_clusters", (nt, fw, st, prod), "smem", smem, {c: fn.max_active_clusters(thr, smem, c) for c in (1, 2, 3, 4)}, flush=True)
PY
           echo "s45g clusters rc=$?"; cat "$OUT/s45g.log"
           timeout 100 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.3 --m 16,64,192,256,300 \
             --configs route,route+c4,route+ws,route+c4,route --shapes 4096x4096,14336x4096,8192x8192 >> "$OUT/s45g.log" 2>&1
           echo "s45g probe rc=$?"; grep -c " us" "$OUT/s45g.log";;
    s45f)  # session 45: the GPU test files s45c-s45e did not run, on the final kernels (model, MoE, MoE utilities, tuning)
           timeout ${S45F_TIMEOUT:-300} python3 -m pytest -q -rs tests/gpu/test_model_gpu.py tests/gpu/test_moe_gpu.py \
             tests/gpu/test_moe_util_gpu.py tests/gpu/test_tuning_gpu.py > "$OUT/s45f.log" 2>&1
           echo "s45f rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s45f.log" | tail -8;;
    s45e)  # session 45: are two K splits in a cluster faster than the route's four (or eight) through the workspace?
           # The route against its tile forced to two splits (clusters of 2), then the GPU test files that
           # exercise the dense op (checkpoint, formats, gemm, linear)
           timeout 150 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.3 --m ${S45E_M:-16,64,129,192,256,300} \
             --configs route,wgmma-n64-f1-s6-k2,wgmma-n128-f1-s4-k2,wgmma-n144-f1-s6-k2-p2,wgmma-n192-f1-s6-k2-p2,wgmma-n256-f1-s4-k2-p2,wgmma-n160-f2-s4-k2-p2,route \
             --shapes ${S45E_SHAPES:-4096x4096,14336x4096,11008x4096,4096x11008} > "$OUT/s45e.log" 2>&1
           echo "s45e rc=$?"; grep -c " us" "$OUT/s45e.log"; grep -i "failed\|error" "$OUT/s45e.log" | head -5
           timeout ${S45E_TESTS_TIMEOUT:-380} python3 -m pytest -q -rs tests/gpu/test_checkpoint_gpu.py tests/gpu/test_formats_gpu.py \
             tests/gpu/test_gemm_gpu.py tests/gpu/test_linear_gpu.py > "$OUT/s45e_tests.log" 2>&1
           echo "s45e tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s45e_tests.log" | tail -8;;
    s45d)  # session 45: clusters of 2 only (s45c: clusters of 4 lost up to 1.8x), launched only where they take no
           # more rounds: the cluster GPU tests (which also run clusters of 3 and 4), the route against the
           # workspace (+ws) on the K-split cells, two interleaved rounds, bf16 and 8-bit too, then bench_gemm at
           # mid M
           timeout ${S45D_TEST_TIMEOUT:-150} python3 -m pytest -q -x -rs tests/gpu/test_wgmma_gpu.py -k "cluster_sum or k_splits or cuda_graph" \
             > "$OUT/s45d_test.log" 2>&1
           echo "s45d test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|Error" "$OUT/s45d_test.log" | tail -8
           for r in 1 2; do
             timeout 120 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.3 \
               --m ${S45D_M:-16,64,129,192,256,300,384,544} --configs route,route+ws \
               --shapes ${S45D_SHAPES:-4096x4096,14336x4096,8192x8192,11008x4096,4096x12288,28672x8192,13824x5120} \
               >> "$OUT/s45d.log" 2>&1
             echo "s45d probe $r rc=$?"
           done
           for v in "--dtype bf16" "--dtype f16 --bits 8"; do
             timeout 60 python3 benchmarks/probe_configs.py $v --settle 0.3 --m 64,256,300 --configs route,route+ws,route \
               --shapes 8192x8192,4096x12288,14336x4096 >> "$OUT/s45d_fmt.log" 2>&1
             echo "s45d fmt $v rc=$?"
           done
           grep -c " us" "$OUT/s45d.log" "$OUT/s45d_fmt.log"; grep -i "failed\|error" "$OUT/s45d.log" "$OUT/s45d_fmt.log" | head -5
           timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_gemm.py --json "$OUT/s45d_bench.json" --peers humming \
             --variants none --m 64,129,256,300 > "$OUT/s45d_bench.log" 2>&1
           echo "s45d bench rc=$?"; grep -E "^\| [0-9]" "$OUT/s45d_bench.log" | head -40;;
    s45c)  # session 45: wgmma K splits summed in clusters through distributed shared memory (gemm.WGMMA_CLUSTER_SUM):
           # the split / cluster GPU tests, then the route against the route with the workspace fixup (+ws), two
           # interleaved rounds, then the rest of the wgmma GPU tests
           timeout ${S45C_TEST_TIMEOUT:-150} python3 -m pytest -q -x -rs tests/gpu/test_wgmma_gpu.py -k "cluster_sum or k_splits" \
             > "$OUT/s45c_test.log" 2>&1
           echo "s45c test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|Error" "$OUT/s45c_test.log" | tail -8
           for r in 1 2; do
             timeout 120 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.3 \
               --m ${S45C_M:-16,64,129,192,256,300,544} --configs route,route+ws \
               --shapes ${S45C_SHAPES:-4096x4096,14336x4096,8192x8192,4096x11008,11008x4096,4096x12288,8192x28672} \
               >> "$OUT/s45c.log" 2>&1
             echo "s45c probe $r rc=$?"
           done
           grep -c " us" "$OUT/s45c.log"; grep -i "failed\|error" "$OUT/s45c.log" | head -5
           timeout ${S45C_REST_TIMEOUT:-230} python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py -k "not cluster_sum and not k_splits" \
             > "$OUT/s45c_rest.log" 2>&1
           echo "s45c rest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s45c_rest.log" | tail -8;;
    s45b)  # session 45: what the wgmma kernel's K-split / stream-K fixup costs: the route with the default build,
           # -DJM_WG_FIXUP_NOSUM (partials stored, arrival counted, the last piece does not sum: wrong results) and
           # -DJM_WG_NO_FIXUP (no fixup at all: wrong results), two interleaved rounds
           for r in 1 2; do
             for f in "" -DJM_WG_FIXUP_NOSUM -DJM_WG_NO_FIXUP; do
               echo "### flags '$f' round $r" >> "$OUT/s45b.log"
               JITMARLIN_NVCC_FLAGS="$f" timeout 80 python3 benchmarks/probe_configs.py --dtype f16 --settle 0.3 \
                 --m ${S45B_M:-16,64,129,192,256,300,544} --configs route \
                 --shapes ${S45B_SHAPES:-4096x4096,14336x4096,8192x8192,4096x11008,11008x4096,4096x12288,8192x28672} \
                 >> "$OUT/s45b.log" 2>&1
               echo "s45b '$f' $r rc=$?"
             done
           done
           grep -c " us" "$OUT/s45b.log";;
    s45a)  # PREPARED in session 44 (not run): the data for a cost model over all of M = 129-1024 (the table's rows route
           # M = 129-256 now): every tall tile whole and stream-K, the route and the route without tall tiles, at
           # M = 129-256 on 12 shapes. Then: python benchmarks/fit_tall_cost.py --all-m benchmarks/logs/s43d.log
           # benchmarks/logs/s44a.log benchmarks/logs/s44c.log s45a.log, and compare the model's picks below 257 with
           # the table's (leave-one-shape-out in the script's output)
           timeout ${S45A_TIMEOUT:-400} python3 benchmarks/probe_configs.py --dtype f16 --settle 0.3 --m ${S45A_M:-129,144,160,176,192,224,256} \
             --configs routeT0,route,wgmma-n144-f2-s4-p2,wgmma-n144-f2-s4-sk-p2,wgmma-n144-f1-s6-p2,wgmma-n144-f1-s6-sk-p2,wgmma-n160-f2-s4-p2,wgmma-n160-f2-s4-sk-p2,wgmma-n192-f1-s6-p2,wgmma-n192-f1-s6-sk-p2,wgmma-n256-f1-s4-p2,wgmma-n256-f1-s4-sk-p2,routeT0 \
             --shapes ${S45A_SHAPES:-8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x12288,4096x11008,4096x4096,4096x22016,5120x13824,13824x5120,3584x18944} \
             > "$OUT/s45a.log" 2>&1
           echo "s45a rc=$?"; grep -c " us" "$OUT/s45a.log"; grep "failed\|Error" "$OUT/s45a.log" | head -5;;
    s44d)  # session 44: the two-strip 144- / 160-token tiles at M = 129-160 on K*N in (2^26, 2^27) where N >= 24576 (new
           # table rows) against the one-strip ones, then the tall-route GPU test, then the GPU test files s44c's run did
           # not reach
           timeout ${S44D_TIMEOUT:-90} python3 benchmarks/probe_configs.py --dtype f16 --settle 0.3 --m 129,144,160 \
             --configs route,wgmma-n144-f2-s4-p2,wgmma-n160-f2-s4-p2,wgmma-n144-f1-s6-p2,wgmma-n192-f1-s6-p2,wgmma-n144-f2-s4-sk-p2,route \
             --shapes 4096x28672,4096x24576,4096x22016 > "$OUT/s44d.log" 2>&1
           echo "s44d rc=$?"; grep -c " us" "$OUT/s44d.log"
           timeout 100 python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py -k "tall_token_tile" > "$OUT/s44d_tall.log" 2>&1
           echo "s44d tall rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s44d_tall.log" | tail -8
           timeout ${S44D_TESTS_TIMEOUT:-240} python3 -m pytest -q -rs tests/gpu/test_model_gpu.py tests/gpu/test_moe_gpu.py \
             tests/gpu/test_moe_util_gpu.py tests/gpu/test_tuning_gpu.py > "$OUT/s44d_rest.log" 2>&1
           echo "s44d rest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s44d_rest.log" | tail -8;;
    s44c)  # session 44: session 42's prepared s43b (deeper rings for the tall tiles, built as extras) with the 160-token
           # stream-K forms added, at fewer M
           timeout ${S44C_TIMEOUT:-230} python3 benchmarks/probe_configs.py --dtype f16 --settle 0.3 \
             --extra-wgmma 256-1-5-p2,144-2-6-p2,160-2-6-p2,144-1-8-p2 --m ${S44C_M:-129,144,256,300,544,640,800,1024} \
             --configs ${S44C_CONFIGS:-route,wgmma-n144-f2-s4-p2,wgmma-n144-f2-s6-p2,wgmma-n160-f2-s4-p2,wgmma-n160-f2-s6-p2,wgmma-n160-f2-s4-sk-p2,wgmma-n160-f2-s6-sk-p2,wgmma-n144-f1-s6-p2,wgmma-n144-f1-s8-p2,wgmma-n256-f1-s4-p2,wgmma-n256-f1-s5-p2,route} \
             --shapes ${S44C_SHAPES:-8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x12288} > "$OUT/s44c.log" 2>&1
           echo "s44c rc=$?"; grep -c " us" "$OUT/s44c.log"; grep "failed\|Error" "$OUT/s44c.log" | head -5;;
    s44b)  # session 44: the cost model routes the tall tiles above M = 256: the wgmma GPU tests, bf16 and 8-bit checks
           # of the route against the table's rows (routeTab) and no tall tiles (routeT0), bench_gemm at mid M
           timeout ${S44B_TEST_TIMEOUT:-220} python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py > "$OUT/s44b_test.log" 2>&1
           echo "s44b test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s44b_test.log" | tail -12
           for v in "--dtype bf16" "--dtype f16 --bits 8"; do
             timeout 70 python3 benchmarks/probe_configs.py $v --settle 0.3 --m 300,544,700,896 \
               --configs routeT0,route,routeTab,route,routeT0 --shapes 8192x28672,28672x8192,8192x8192,4096x12288 \
               >> "$OUT/s44b_fmt.log" 2>&1
             echo "s44b fmt $v rc=$?"
           done
           grep -c " us" "$OUT/s44b_fmt.log"
           timeout ${S44B_BENCH_TIMEOUT:-150} python3 benchmarks/bench_gemm.py --json "$OUT/s44b_bench.json" \
             --variants none --m ${S44B_M:-300,544,640,800} > "$OUT/s44b_bench.log" 2>&1
           echo "s44b bench rc=$?"; tail -30 "$OUT/s44b_bench.log";;
    s44a)  # session 44 (ran on branch exp-cost-model, where `route` was the table's rows and routeCM the cost model;
           # on main now: route = the cost model, routeTab = the table): on shapes the s43d fit never saw (Llama-3-8B,
           # Qwen2-7B, Mistral-Nemo, Yi-34B-like) and three it did, fp16 4-bit, M = 257-1024; twice so the noise shows
           timeout ${S44A_TIMEOUT:-420} python3 benchmarks/probe_configs.py --dtype f16 --settle 0.3 \
             --m ${S44A_M:-257,300,384,448,544,600,700,800,896,1000} --configs routeT0,routeTab,route,routeTab,route,routeT0 \
             --shapes ${S44A_SHAPES:-4096x14336,14336x4096,4096x6144,3584x18944,18944x3584,3584x4608,5120x14336,14336x5120,7168x20480,8192x28672,4096x11008,4096x4096} \
             > "$OUT/s44a.log" 2>&1
           echo "s44a rc=$?"; grep -c " us" "$OUT/s44a.log"; grep "failed\|Error" "$OUT/s44a.log" | head -5;;
    s43e)  # session 43: the final route (s43a/s43d rows, stream-K hybrid): the tall-route GPU test, bench_gemm
           # at M = 300 / 544 / 640 / 800 with the peers, and the e2e Llama subset (prefill 128-2048)
           timeout 120 python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py -k "tall_token_tile or two_warpgroup_stream_k" \
             > "$OUT/s43e_test.log" 2>&1
           echo "s43e test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s43e_test.log" | tail -8
           timeout ${S43E_BENCH_TIMEOUT:-150} python3 benchmarks/bench_gemm.py --json "$OUT/s43e_bench.json" \
             --variants none --m ${S43E_M:-300,544,640,800} > "$OUT/s43e_bench.log" 2>&1
           echo "s43e bench rc=$?"; tail -30 "$OUT/s43e_bench.log"
           timeout ${E2E_TIMEOUT:-240} python3 benchmarks/bench_e2e.py --json "$OUT/e2e.json" --models llama \
             --variants fp16,w4,w4-fused --batches 1,8 --prefill 128,512,1024,2048 --decode 128 --time-budget 200 > "$OUT/e2e.log" 2>&1
           echo "e2e rc=$?"; tail -25 "$OUT/e2e.log";;
    s43d)  # session 43: stream-K of the two-compute-warpgroup form as whole-tile rounds + stream-K over the tiles
           # left (jm_wgmma.cuh kWgHybrid); first the wgmma GPU tests on it, then the route (s43a rows) against
           # routeT0 with every tall tile whole (ws) and stream-K (sk), then the same sk configs built
           # -DJM_WG_NO_HYBRID (stream-K over all tiles: session 42's machine code), bf16 / 8-bit route checks
           timeout ${S43D_TEST_TIMEOUT:-220} python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py > "$OUT/s43d_test.log" 2>&1
           echo "s43d test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s43d_test.log" | tail -12
           sh43=${S43D_SHAPES:-8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x12288,4096x11008,4096x4096,5120x13824,13824x5120,2048x8192}
           m43=${S43D_M:-300,384,544,600,640,700,768,800,896,1024}
           timeout ${S43D_TIMEOUT:-170} python3 benchmarks/probe_configs.py --dtype f16 --settle 0.3 --m $m43 \
             --configs routeT0,route,wgmma-n160-f2-s4-p2,wgmma-n160-f2-s4-sk-p2,wgmma-n192-f1-s6-p2,wgmma-n192-f1-s6-sk-p2,wgmma-n256-f1-s4-p2,wgmma-n256-f1-s4-sk-p2,routeT0 \
             --shapes $sh43 > "$OUT/s43d.log" 2>&1
           echo "s43d rc=$?"; grep -c " us" "$OUT/s43d.log"; grep "failed\|Error" "$OUT/s43d.log" | head -5
           JITMARLIN_NVCC_FLAGS=-DJM_WG_NO_HYBRID timeout ${S43D_TIMEOUT2:-90} python3 benchmarks/probe_configs.py --dtype f16 \
             --settle 0.3 --m $m43 --configs route,wgmma-n160-f2-s4-sk-p2,wgmma-n192-f1-s6-sk-p2,wgmma-n256-f1-s4-sk-p2 \
             --shapes $sh43 > "$OUT/s43d_nohyb.log" 2>&1
           echo "s43d nohyb rc=$?"; grep -c " us" "$OUT/s43d_nohyb.log"
           for v in "--dtype bf16" "--dtype f16 --bits 8"; do
             timeout 60 python3 benchmarks/probe_configs.py $v --settle 0.3 --m 300,600,800,896 --configs routeT0,route,routeT0 \
               --shapes 8192x28672,28672x8192,8192x8192,4096x12288 >> "$OUT/s43d_fmt.log" 2>&1
             echo "s43d fmt rc=$?"
           done;;
    s43b)  # PREPARED in session 42 (main; not run in session 43): deeper rings for the tall tiles (the routed ones use 111-179 KB of shared
           # memory in fp16 4-bit: (144, 2, 4) and (160, 2, 4) at 4 stages, (256, 1, 4)), built as extras: ptxas
           # (sm_90a, fp16 4-bit g128) (256, 1, 5) and (144, 1, 8) 0 spill bytes, (144, 2, 6) 20, (160, 2, 6) 36
           timeout ${S43B_TIMEOUT:-300} python3 benchmarks/probe_configs.py --dtype f16 --settle 0.3 \
             --extra-wgmma 256-1-5-p2,144-2-6-p2,160-2-6-p2,144-1-8-p2 --m ${S43B_M:-129,144,160,256,300,512,600,768,800,1024} \
             --configs ${S43B_CONFIGS:-route,wgmma-n144-f2-s4-p2,wgmma-n144-f2-s6-p2,wgmma-n160-f2-s4-p2,wgmma-n160-f2-s6-p2,wgmma-n144-f1-s6-p2,wgmma-n144-f1-s8-p2,wgmma-n256-f1-s4-p2,wgmma-n256-f1-s5-p2,route} \
             --shapes ${S43B_SHAPES:-8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x12288} > "$OUT/s43b.log" 2>&1
           echo "s43b rc=$?"; grep -c " us" "$OUT/s43b.log"; grep "failed\|Error" "$OUT/s43b.log" | head -5;;
    s42c)  # session 42: the wgmma GPU tests (s42b's whole-suite run timed out at 320 s before them; the files
           # before passed) and bench_gemm at M = 129 / 256 / 512 / 1024 with the peers (the README rows the tall-tile
           # route changes)
           timeout ${S42C_TEST_TIMEOUT:-220} python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py > "$OUT/s42c_test.log" 2>&1
           echo "s42c test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s42c_test.log" | tail -12
           timeout ${S42C_BENCH_TIMEOUT:-250} python3 benchmarks/bench_gemm.py --json "$OUT/s42c_bench.json" \
             --variants none --m 129,256,512,1024 > "$OUT/s42c_bench.log" 2>&1
           echo "s42c bench rc=$?"; grep -E "^\| [0-9]|copy|bandwidth" "$OUT/s42c_bench.log";;
    s42b)  # session 42: the tall-tile route of WGMMA_TALL_ROUTE (M = 129-1024) against the route without it (routeT0)
           # and each tile with stream-K (the route takes whole tiles / K splits where stream-K idles under 32 stages),
           # fp16 4-bit on 8 shapes, bf16 4-bit and fp16 8-bit on 3; then the whole GPU suite.
           timeout ${S42B_TIMEOUT:-200} python3 benchmarks/probe_configs.py --dtype f16 --settle 0.3 \
             --m ${S42B_M:-129,144,160,192,256,320,384,512,768,1024} \
             --configs ${S42B_CONFIGS:-routeT0,route,wgmma-n144-f2-s4-sk-p2,wgmma-n160-f2-s4-sk-p2,wgmma-n144-f1-s6-sk-p2,wgmma-n192-f1-s6-sk-p2,wgmma-n256-f1-s4-sk-p2} \
             --shapes ${S42B_SHAPES:-8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x12288,4096x11008,4096x4096} \
             > "$OUT/s42b.log" 2>&1
           echo "s42b rc=$?"; grep -c " us" "$OUT/s42b.log"; grep "failed\|Error" "$OUT/s42b.log" | head -5
           for spec in "bf16 4" "f16 8"; do set -- $spec
             timeout 60 python3 benchmarks/probe_configs.py --dtype $1 --bits $2 --settle 0.3 --m 129,192,256,512,1024 \
               --configs routeT0,route --shapes 8192x28672,8192x8192,4096x12288 >> "$OUT/s42b_fmt.log" 2>&1
             echo "s42b $1 u$2 rc=$?"
           done
           timeout ${S42B_TEST_TIMEOUT:-320} python3 -m pytest -q -rs tests/gpu > "$OUT/s42b_test.log" 2>&1
           echo "s42b test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s42b_test.log" | tail -12;;
    s42a)  # session 42: the tall token tiles per shape after s41e (route = 144 / 160 / 192 f2 / 256 f1 stream-K where
           # the tiles' stages allow): each candidate with stream-K (-sk) and with the library's split choice, the
           # one-strip 144 / 160 tiles (built as extras), routeT0 first and last (drift check), settle 0.3 s
           timeout ${S42A_TIMEOUT:-280} python3 benchmarks/probe_configs.py --dtype f16 --settle 0.3 \
             --extra-wgmma 144-1-6-p2,160-1-6-p2 --m ${S42A_M:-129,144,160,176,192,224,256} \
             --configs ${S42A_CONFIGS:-routeT0,route,wgmma-n144-f2-s4-sk-p2,wgmma-n144-f1-s6-sk-p2,wgmma-n160-f2-s4-sk-p2,wgmma-n160-f1-s6-sk-p2,wgmma-n192-f1-s6-sk-p2,wgmma-n192-f1-s6-p2,wgmma-n256-f1-s4-sk-p2,wgmma-n256-f1-s4-p2,routeT0} \
             --shapes ${S42A_SHAPES:-8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x12288,4096x11008,4096x4096} \
             > "$OUT/s42a.log" 2>&1
           echo "s42a rc=$?"; grep -c " us" "$OUT/s42a.log"; grep "failed\|Error" "$OUT/s42a.log" | head -5
           timeout ${S42A_BF16_TIMEOUT:-80} python3 benchmarks/probe_configs.py --dtype bf16 --settle 0.3 \
             --extra-wgmma 144-1-6-p2,160-1-6-p2 --m 129,160,192,256 \
             --configs routeT0,route,wgmma-n144-f1-s6-sk-p2,wgmma-n192-f1-s6-sk-p2,wgmma-n256-f1-s4-sk-p2,routeT0 \
             --shapes 8192x28672,8192x8192,4096x12288 > "$OUT/s42a_bf16.log" 2>&1
           echo "s42a bf16 rc=$?"; grep -c " us" "$OUT/s42a_bf16.log"
           # two tall tiles past 256 rows (s41e: 8192x28672 M = 512 n256 f1 stream-K 400.2 us vs the route 445.3)
           timeout ${S42A_TWO_TIMEOUT:-150} python3 benchmarks/probe_configs.py --dtype f16 --settle 0.3 \
             --m 288,320,384,512,768,1024 --configs routeT0,wgmma-n192-f1-s6-sk-p2,wgmma-n256-f1-s4-sk-p2,wgmma-n256-f1-s4-p2 \
             --shapes ${S42A_SHAPES:-8192x28672,28672x8192,4096x28672,8192x8192,14336x4096,4096x12288,4096x11008,4096x4096} \
             > "$OUT/s42a_two.log" 2>&1
           echo "s42a two rc=$?"; grep -c " us" "$OUT/s42a_two.log";;
    s41e)  # session 41: token tiles of 144 / 160 / 192 / 256 rows (wgmma n144..n256) in the two-compute-warpgroup
           # producer form, one token tile where the route runs two of 128 (M = 129-256: the bench of s41d, 8192x28672 M = 129
           # 194.9 us vs Humming 96.7, cuBLAS 115.7). Against the route and the same form at 128 tokens, stream-K
           # (-sk); the probe checks each output against the reference (err). Ran in session 42 on 668179b (the first
           # rule, WGMMA_TALL_ROUTE as a list of tiles; (192, 2, 4) is no longer built: its configs fail there now).
           timeout ${S41E_TIMEOUT:-270} python3 benchmarks/probe_configs.py --dtype f16 --m ${S41E_M:-129,160,192,256,512} \
             --configs ${S41E_CONFIGS:-route,routeT0,wgmma-n128-f2-s4-sk-p2,wgmma-n144-f2-s4-sk-p2,wgmma-n160-f2-s4-sk-p2,wgmma-n192-f1-s6-sk-p2,wgmma-n192-f2-s4-sk-p2,wgmma-n256-f1-s4-sk-p2} \
             --shapes ${S41E_SHAPES:-8192x28672,8192x8192,4096x12288,4096x4096} > "$OUT/s41e.log" 2>&1
           echo "s41e rc=$?"; grep " us\|failed" "$OUT/s41e.log" | sed 's/^\[default\] f16 u4 //'
           timeout ${S41E_TEST_TIMEOUT:-170} python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py \
             -k "tall_token_tile_route_in or partial_last_tile or (tall_token_tile_route and (u8-g32-zp or (float16-u4-g128 and not bfloat16)))" \
             > "$OUT/s41e_test.log" 2>&1
           echo "s41e test rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/s41e_test.log" | tail -12
           timeout ${S41E_BENCH_TIMEOUT:-100} python3 benchmarks/bench_gemm.py --json "$OUT/s41e_bench.json" --peers humming \
             --variants none --m 129,160,256 --shapes 8192x28672,8192x8192,4096x12288,4096x4096 > "$OUT/s41e_bench.log" 2>&1
           echo "s41e bench rc=$?"; grep -E "^\| [0-9]" "$OUT/s41e_bench.log";;
    s41d)  # session 41 (a record: the flag was removed after this run, which it lost). The act-order gathers'
           # trigger after their wait (-DJM_GATHER_TRIGGER_AFTER_WAIT, F below) vs first (default), interleaved default, F, F, default with
           # the library's wgmma PDL rule (-1) and F / default with the wgmma kernel always a programmatic
           # dependent of the gather (1); then the act-order GPU tests on the flagged build (flipping the default
           # gives the flagged build's machine code); then bench_gemm with Humming at M just past a multiple of 128
           # (session 40's moved box against the peers; BENCH_TIMEOUT, default 200 s here).
           for spec in ":-1" "F:-1" "F:1" ":1" "F:-1" ":-1"; do
             f=${spec%%:*}; w=${spec##*:}; [ "$f" = F ] && f=-DJM_GATHER_TRIGGER_AFTER_WAIT
             JITMARLIN_NVCC_FLAGS="$f" timeout 80 python3 benchmarks/probe_act_order.py --wgmma-pdl $w --m 1,8,16 \
               --shapes 4096x4096,14336x4096,8192x8192,4096x28672,28672x8192,8192x28672 >> "$OUT/s41d.log" 2>&1
             echo "s41d flags '$f' wgmma-pdl $w rc=$?"
           done
           grep -v "^jitmarlin" "$OUT/s41d.log" | tail -120
           JITMARLIN_NVCC_FLAGS=-DJM_GATHER_TRIGGER_AFTER_WAIT timeout ${S41D_TEST_TIMEOUT:-150} python3 -m pytest -q -rs \
             tests/gpu -k "act_order or perm or gather" > "$OUT/s41d_test.log" 2>&1
           echo "s41d test rc=$?"; tail -4 "$OUT/s41d_test.log"
           timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_gemm.py --json "$OUT/s41b.json" --peers humming \
             --variants none --m 129,144,160,257,288 \
             --shapes 8192x8192,4096x12288,4096x11008,14336x4096,4096x4096,8192x28672 > "$OUT/s41b.log" 2>&1
           echo "s41b rc=$?"; grep -E "^\| [0-9]" "$OUT/s41b.log";;
    s40c)  # session 40: the shifted partial last tile (jm_wgmma.cuh atok0) vs the box at tok0 (-DJM_WG_NO_SHIFT),
           # two interleaved rounds of the route, then the wgmma GPU tests
           for r in 1 2; do
             for f in "" -DJM_WG_NO_SHIFT; do
               JITMARLIN_NVCC_FLAGS="$f" timeout 150 python3 benchmarks/probe_configs.py --dtype f16 \
                 --m ${S40_M:-17,40,65,100,129,144,160,192,257,320,400,640,1000} --configs route \
                 --shapes ${S40_SHAPES:-8192x8192,4096x12288,4096x11008,14336x4096,8192x28672,28672x8192,4096x4096} \
                 >> "$OUT/s40c.log" 2>&1
               echo "s40c round $r flags '$f' rc=$?"
             done
           done
           grep -c " us" "$OUT/s40c.log"
           timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -rs tests/gpu/test_wgmma_gpu.py > "$OUT/s40c_test.log" 2>&1
           echo "s40c test rc=$?"; tail -8 "$OUT/s40c_test.log";;
    s40a)  # PREPARED in session 39 (probe only): the M = 129 / 144 effect (s39d: without any split, 1.1-1.6x slower
           # than M = 192 on the same launch on 8192^2, 4096x12288, 4096x11008, 14336x4096). Three passes of the
           # route over M around 128 / 192 (if it holds: ncu on M = 129 vs 192, then the TMA box past M).
           timeout 150 python3 benchmarks/probe_configs.py --dtype f16 --m 96,120,128,129,130,136,144,160,176,192,256 \
             --configs route,route,route --shapes 8192x8192,4096x12288,4096x11008,14336x4096,8192x28672 \
             > "$OUT/s40a.log" 2>&1
           echo "s40a rc=$?"; grep " us" "$OUT/s40a.log";;
    moeprof) timeout 120 python3 benchmarks/profile_moe.py > "$OUT/moeprof.log" 2>&1; echo "moeprof rc=$?"
           grep -v "^jitmarlin" "$OUT/moeprof.log" | head -60;;
    e2e)   timeout ${E2E_TIMEOUT:-600} python3 benchmarks/bench_e2e.py --json "$OUT/e2e.json" ${E2E_ARGS:-} > "$OUT/e2e.log" 2>&1
           echo "e2e rc=$?"; tail -40 "$OUT/e2e.log";;
  esac
  echo "stage $st took $(( $(date +%s) - t0 )) s"
done
# The device tool returns at most 8 files from $OUT (session 16 lost tests.log that way): past 8, the
# logs travel as one archive, all_logs.tgz (tar xzf it; gpu.txt stays beside it).
n=$(find "$OUT" -type f | wc -l)
if [ "$n" -gt 8 ]; then
  tar czf /tmp/jm-all-logs.tgz -C "$OUT" . && find "$OUT" -type f ! -name gpu.txt -delete \
    && mv /tmp/jm-all-logs.tgz "$OUT/all_logs.tgz" && echo "run_device: $n files under \$OUT bundled into all_logs.tgz"
fi
