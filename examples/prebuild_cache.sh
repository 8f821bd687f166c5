#!/usr/bin/env bash
# usage: examples/prebuild_cache.sh [CACHE_DIR]          (default /opt/jitmarlin-cache)
#
# Prebuild jitmarlin's kernels into a cache directory, e.g. as a step of a deployment image, so
# that the serving process never runs nvcc (and needs no CUDA toolkit at all).
#
# What to build comes from the environment (comma-separated lists, defaults in brackets):
#   JITMARLIN_ARCHS   GPU architectures                         [8.0,9.0]   (A100, H100/H200; 8.6/8.9 for A10/L4/RTX)
#   JITMARLIN_DTYPES  activation dtypes f16, bf16                [f16,bf16]
#   JITMARLIN_BITS    weight bits 4, 8                           [4]
#   JITMARLIN_GROUPS  group sizes: -1, 32, 64, multiples of 128  [128]
# For each combination it builds the dense GEMM kernels symmetric (GPTQ sym, quantize_model) and
# with zero points (AWQ, asymmetric GPTQ), with the act-order forms of the sm_90 strip kernels
# (GPTQ desc_act), and the same two for mixture-of-experts layers. No GPU
# is needed (--arch names the targets); nvcc of the CUDA major version of torch is.
#
# In a Dockerfile (build as the user that will run the server: jitmarlin refuses cache
# directories owned by another user or writable by group/others):
#   USER app
#   RUN examples/prebuild_cache.sh /home/app/jitmarlin-cache
#   ENV JITMARLIN_CACHE_DIR=/home/app/jitmarlin-cache JITMARLIN_DISABLE_JIT=1
# With JITMARLIN_DISABLE_JIT=1 a kernel missing from the cache is an error that prints the
# `jitmarlin build ...` command that adds it. The cache is per jitmarlin and torch version
# (<root>/<jitmarlin version>/torch<version>-cu<cuda>/sm_XY/...): build it with the packages the
# server runs.
set -euo pipefail

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 0
fi

cache_dir="${1:-/opt/jitmarlin-cache}"
archs="${JITMARLIN_ARCHS:-8.0,9.0}"
dtypes="${JITMARLIN_DTYPES:-f16,bf16}"
bits="${JITMARLIN_BITS:-4}"
groups="${JITMARLIN_GROUPS:-128}"

mkdir -p "$cache_dir"
chmod go-w "$cache_dir"
export JITMARLIN_CACHE_DIR="$cache_dir"

# the `jitmarlin` command of a pip install, else the package on PYTHONPATH
if command -v jitmarlin >/dev/null 2>&1; then jm=(jitmarlin); else jm=("${PYTHON:-python3}" -m jitmarlin); fi
"${jm[@]}" info
common=(--arch "$archs" --dtype "$dtypes" --bits "$bits" "--group-size=$groups")
"${jm[@]}" build "${common[@]}" --act-order           # dense, symmetric (+ act-order strip forms, sm_90)
"${jm[@]}" build "${common[@]}" --zero-points --act-order  # dense, zero points
"${jm[@]}" build "${common[@]}" --moe                 # mixture of experts, symmetric
"${jm[@]}" build "${common[@]}" --moe --zero-points   # mixture of experts, zero points
"${jm[@]}" cache list
echo "cache ready: export JITMARLIN_CACHE_DIR=$cache_dir JITMARLIN_DISABLE_JIT=1"
