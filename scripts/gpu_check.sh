#!/usr/bin/env bash
# GPU check of zyx on a fresh NVIDIA machine, in one command:
#
#   scripts/gpu_check.sh OUTDIR [WHEELS_DIR]        (or WHEELS=dir scripts/gpu_check.sh OUTDIR)
#
# The machine has python3 (3.12) with torch, numpy, networkx, pytest, cuda-bindings, NVRTC and cuDNN, but not
# nvidia-cudnn-frontend: its cp312 wheel (and any other missing wheel) is carried in WHEELS_DIR. Steps, each with
# its own time limit, all logged into OUTDIR (the run goes on after a failed step; the exit status is the first
# failure's):
#   1. nvidia-smi
#   2. the carried wheels (cudnn-frontend with --no-deps) into OUTDIR/site, put on PYTHONPATH with the repo (the
#      image's python3 is itself a venv: a venv made from it would not see its packages)
#   3. a check that zyx, numpy, ml_dtypes and cudnn import
#   4. what zyx finds (registry report, device info, python -m zyx on cuda)
#   5. the CUDA backend's GPU tests (tests/backends/test_cuda_gpu.py)
#   6. scripts/gpu_bench.py (JSON in OUTDIR), then the host-overhead rows of python -m zyx.bench (launches/s,
#      graph replay, flush with live buffers, upload)
#   7. scripts/gpu_kernel_variants.py: column sum, row sum and softmax kernels alone (launch_timed) under each
#      unroll, beside their end-to-end time, the copy bandwidth and torch
#   8. the rest of pytest -m cuda (the op parity suite on cuda:0, over 8 xdist workers; junit XML in OUTDIR) with
#      the time left
# then a summary, the benchmark table last. Every step has a time limit, and all limits are capped by a total
# deadline (GPU_CHECK_TOTAL_S, default 540 s), so the whole run stays under 10 minutes. pytest is stopped with
# SIGINT at its limit, so it still prints (and writes XML for) what it ran.
set -uo pipefail

OUT=${1:?usage: scripts/gpu_check.sh OUTDIR [WHEELS_DIR]}
WHEELS=${2:-${WHEELS:-}}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SITE="$OUT/site"
VPY=$PY
: > "$OUT/steps.tsv"
FIRST_FAIL=0
START=$(date +%s)
TOTAL=${GPU_CHECK_TOTAL_S:-540}
export CUDA_PYTHON_DISABLE_MAJOR_VERSION_WARNING=1
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"  # the repo and the carried wheels
export XDG_CACHE_HOME="$OUT/cache"                    # fresh compile caches, kept with the results

log() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$OUT/gpu_check.log"; }

# step NAME SECONDS CMD...: run CMD in the repo with a time limit (capped by the deadline), output in
# OUTDIR/NAME.log; record status and duration
step() {
    local name=$1 limit=$2
    shift 2
    local left=$(( TOTAL - ($(date +%s) - START) - 10 ))
    if [ "$left" -lt 15 ]; then
        log "$name skipped: the ${TOTAL}s deadline is reached"
        printf '%s\t%s\t%s\n' "$name" skipped 0 >> "$OUT/steps.tsv"
        return 124
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    log "$name (limit ${limit}s): $*"
    local t0 rc
    t0=$(date +%s)
    (cd "$REPO" && timeout --signal=INT --kill-after=15 "$limit" "$@") > "$OUT/$name.log" 2>&1
    rc=$?
    local secs=$(( $(date +%s) - t0 ))
    printf '%s\t%s\t%s\n' "$name" "$rc" "$secs" >> "$OUT/steps.tsv"
    if [ "$rc" -ne 0 ]; then
        log "$name FAILED (exit $rc after ${secs}s); last lines of $OUT/$name.log:"
        tail -n 15 "$OUT/$name.log" | sed 's/^/    /' | tee -a "$OUT/gpu_check.log"
        [ "$FIRST_FAIL" -eq 0 ] && FIRST_FAIL=$rc
    else
        log "$name ok (${secs}s)"
    fi
    return "$rc"
}

install_wheels() {
    mkdir -p "$SITE"
    if [ -z "$WHEELS" ]; then
        echo "no WHEELS folder given: skipping carried wheels"
    else
        shopt -s nullglob
        local wheels=("$WHEELS"/*.whl)
        if [ ${#wheels[@]} -gt 0 ]; then
            "$VPY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
                "${wheels[@]}" || return 1
        fi
        [ -n "$(echo "$WHEELS"/nvidia_cudnn_frontend-*.whl)" ] \
            || echo "warning: no nvidia_cudnn_frontend wheel in $WHEELS: cuDNN matmuls will be off"
    fi
    "$VPY" -c "import zyx, numpy, ml_dtypes; print('zyx', zyx.__file__, 'numpy', numpy.__version__)" || return 1
    "$VPY" -c "import cudnn; print('cudnn frontend', getattr(cudnn, '__version__', '?'))" \
        || echo "warning: cudnn frontend not importable"
}

log "repo $REPO, results in $OUT, wheels ${WHEELS:-none}, deadline ${TOTAL}s"
step nvidia_smi 10 nvidia-smi
export -f install_wheels
export VPY WHEELS REPO SITE
step install 80 bash -c install_wheels
step report 60 bash -c '"$VPY" -c "import json, zyx; print(json.dumps(zyx.registry().report(), indent=2)); \
d = zyx.registry().get(\"cuda:0\").primary; print(d); print(d.info())" && "$VPY" -m zyx --device cuda'
step pytest_backend 110 "$VPY" -m pytest -o addopts= -q -p no:cacheprovider -rfEs tests/backends/test_cuda_gpu.py \
    --junitxml="$OUT/pytest_backend.xml"
step bench 120 "$VPY" scripts/gpu_bench.py --out "$OUT" --budget-s 100
step bench_launch 60 "$VPY" -m zyx.bench --only cuda_launch_chain,cuda_launch_independent,cuda_flush_live_buffers,cuda_graph_replay,cuda_upload \
    --repeats 5 --out "$OUT/bench_launch.json"
step kernels 90 "$VPY" scripts/gpu_kernel_variants.py --values 1,4,8
# xdist (in the image) spreads the op parity suite over 8 processes, each with its own context on the one GPU
XDIST=$("$VPY" -c "import xdist" 2>/dev/null && echo "-n 8")
step pytest_cuda 150 "$VPY" -m pytest -m cuda -o addopts= -q -p no:cacheprovider -rfE --continue-on-collection-errors \
    $XDIST --ignore=tests/backends/test_cuda_gpu.py --junitxml="$OUT/pytest_cuda.xml"

echo
echo "==================== gpu_check summary ($OUT) ===================="
printf '%-14s %6s %8s\n' step exit seconds
while IFS=$'\t' read -r name rc secs; do printf '%-14s %6s %8s\n' "$name" "$rc" "$secs"; done < "$OUT/steps.tsv"
echo
for f in pytest_backend pytest_cuda; do
    [ -f "$OUT/$f.log" ] && echo "$f: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/$f.log" | tail -n 1)"
done
echo
echo "---- benchmark (from $OUT/bench.log) ----"
sed -n '/^zyx cuda/,$p' "$OUT/bench.log"
[ -f "$OUT/bench_launch.log" ] && grep '^cuda:' "$OUT/bench_launch.log"
[ -f "$OUT/kernels.log" ] && { echo; echo "---- kernels alone (from $OUT/kernels.log) ----"; cat "$OUT/kernels.log"; }
exit "$FIRST_FAIL"
