#!/usr/bin/env bash
# Every GPU check in one call of the device machine (docs/benchmarks.md, "CPUs and GPUs
# in one run"): install the carried wheels, record the machine, run every GPU test,
# then the GPU side-by-side; logs and figures go to $OUT. About 8 minutes at most.
#
# Here, once: bash benchmarks/device_wheels.sh (fills the git-ignored .whl/). Then the
# device tool's run, with carry [".whl"] and timeout_s 560:
#     bash benchmarks/device_session.sh
#
# What comes back in $OUT: env.txt (GPU, driver, cores, versions), gpu-tests.log and
# gpu-tests.xml (pytest tests/test_gpu.py), side-by-side-gpu.log and .json
# (resnet20 at width 1 and batch 128: `single`, `kernel`, `data` and `hybrid` on a GPU
# worker beside two CPU workers of 4 threads, against plain PyTorch on the GPU), and
# summary.txt (each part's exit status). A part that fails or runs out of its time
# does not stop the next; the script's status is non-zero if any part failed, and 3
# at once, after env.txt, where torch sees no CUDA device (every GPU test would skip).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
export PYTHONUNBUFFERED=1

#: Each part's wall-clock limit in seconds: together well inside the call's 560 s.
TESTS_LIMIT=200
SIDE_BY_SIDE_LIMIT=270

if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "error: no wheels in .whl/: run benchmarks/device_wheels.sh, then carry .whl" >&2
    exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "error: installing .whl/ failed" >&2; exit 2; }
export PYTHONPATH=/tmp/site:$PWD  # the carried wheels first, then this project

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    echo "cores: $(nproc)"
    python3 -c "import sys, torch, dask, distributed, zarr, xarray, numpy, pandas
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda',
      torch.version.cuda, 'available', torch.cuda.is_available(), 'dask', dask.__version__,
      'distributed', distributed.__version__, 'zarr', zarr.__version__, 'xarray',
      xarray.__version__, 'numpy', numpy.__version__, 'pandas', pandas.__version__)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if ! python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "error: torch sees no CUDA device here: every GPU test would skip" >&2
    exit 3
fi

timeout -k 10 "$TESTS_LIMIT" python3 -m pytest -q -rs -p no:cacheprovider \
    -o faulthandler_timeout=120 --junitxml="$OUT/gpu-tests.xml" tests/test_gpu.py \
    2>&1 | tee "$OUT/gpu-tests.log"
tests=${PIPESTATUS[0]}

timeout -k 10 "$SIDE_BY_SIDE_LIMIT" python3 -m benchmarks.side_by_side --net resnet20 \
    --batch 128 --devices cuda:0 cpu cpu --threads 4 --rounds 7 --burst 8 --skip 2 \
    --json "$OUT/side-by-side-gpu.json" 2>&1 | tee "$OUT/side-by-side-gpu.log"
side_by_side=${PIPESTATUS[0]}

printf 'gpu tests: exit %s\nside-by-side: exit %s\n' "$tests" "$side_by_side" \
    | tee "$OUT/summary.txt"
[ "$tests" = 0 ] && [ "$side_by_side" = 0 ]
