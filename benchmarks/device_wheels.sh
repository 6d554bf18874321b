#!/usr/bin/env bash
# Download into .whl/ (git-ignored) the wheels that the GPU device machine's image lacks,
# for benchmarks/device_session.sh to install there (it has no package registry).
#
# The image (Python 3.12, x86-64) holds torch, numpy, pandas, cloudpickle, toolz,
# fsspec, msgpack, psutil, pyyaml, tqdm, jinja2, click, packaging, pillow,
# sortedcontainers and typing-extensions; it lacks what a run imports beyond them:
# Dask and its parts (partd, locket, tblib, zict, tornado), Zarr and its codecs
# (numcodecs, google-crc32c, donfig), and cryptography (the TLS credentials of every
# cluster a run starts) with cffi. xarray is there, but in a version of its own:
# this project's is carried. Bokeh (the dashboard) is left out: without it the
# scheduler serves no plots, nothing else changes. Versions are constraints.txt's.
#
#     bash benchmarks/device_wheels.sh        # about 20 MiB; run once, where pip works
set -euo pipefail
cd "$(dirname "$0")/.."

NAMES=(dask distributed partd locket tblib zict tornado zarr numcodecs google-crc32c donfig
       cryptography cffi pycparser xarray)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_34_x86_64)

pinned() {  # NAME==VERSION as constraints.txt pins it (names compared case-blind)
    local line
    line=$(grep -i -E "^$1==" constraints.txt) || { echo "error: $1 is not pinned in constraints.txt" >&2; exit 2; }
    echo "$line"
}

requirements=()
for name in "${NAMES[@]}"; do
    requirements+=("$(pinned "$name")")
done
mkdir -p .whl
rm -f .whl/*.whl  # one version of each: two of one package stop the whole install
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]/#/--platform=}" -d .whl "${requirements[@]}"
count=$(ls .whl/*.whl | wc -l)
if [ "$count" -ne "${#NAMES[@]}" ]; then
    echo "error: ${#NAMES[@]} packages wanted, $count wheels in .whl/" >&2
    exit 1
fi
du -sh .whl
