#!/usr/bin/env bash
# Where the sm_90a wgmma kernel spends its time (H200): the probe with diagnostic builds that drop
# one part of the main loop (wrong results; JITMARLIN_NVCC_FLAGS is part of the cache key), and
# Nsight Compute's stall reasons for one launch.   bash benchmarks/diag_wgmma.sh  (logs under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/jm-out}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} JITMARLIN_CACHE_DIR=${JITMARLIN_CACHE_DIR:-/tmp/jm-cache}
SHAPES=${DIAG_SHAPES:-8192x28672}; MS=${DIAG_M:-256,1024}
CFGS=${DIAG_CONFIGS:-wgmma-n128-f2-s4,wgmma-n128-f1-s4,wgmma-n64-f2-s4}
for flags in "" -DJM_WG_NOLDS -DJM_WG_NODEQ -DJM_WG_NOMMA; do
  JITMARLIN_QUIET=1 JITMARLIN_NVCC_FLAGS="$flags" timeout 120 python3 benchmarks/probe_configs.py --shapes "$SHAPES" --extra-wgmma 128-2-4 \
    --m "$MS" --configs "$CFGS" 2>&1 | grep -v "^jitmarlin:" | tee -a "$OUT/diag_probe.log"
done
if [ "${DIAG_NCU:-1}" = 1 ]; then
  JITMARLIN_WGMMA=1 timeout 150 ncu --clock-control none --section WarpStateStats --section SourceCounters \
    --print-details all -k regex:jm_wgmma -s 2 -c 1 python3 benchmarks/profile_gemm.py --k 8192 --n 28672 \
    --m ${DIAG_NCU_M:-1024} > "$OUT/diag_ncu.txt" 2>&1
  echo "ncu rc=$?"; grep -iE "stall|Warp Cycles" "$OUT/diag_ncu.txt" | head -40
fi
