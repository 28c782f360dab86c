#!/usr/bin/env bash
# The one device check: GPU tests, the GPU benchmark, then S3 on this quieter machine.
# Runs on the lent GPU machine with only what it already has (torch, cupy, msgpack,
# uvloop, pytest, hypothesis) plus the wheels carried in .gpu/wheels (pyzmq,
# pytest-asyncio). Usage (from the repo root): bash scripts/gpu_check.sh
# Prints a short table last; logs go to $OUT (or /tmp/rlinf-gpu-out).
# The wheels (.gpu/ is git-ignored: carry it), fetched here beforehand:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     -d .gpu/wheels pyzmq pytest-asyncio
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/rlinf-gpu-out}"; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-index .gpu/wheels/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, zmq; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'pyzmq', zmq.__version__)"
status=0
timeout 240 python3 -m pytest -q -p no:cacheprovider -p no:benchmark -o timeout=150 -n 4 --dist loadfile \
    tests/gpu tests/unit/test_codec.py tests/unit/test_routing.py tests/unit/test_devices.py \
    tests/unit/test_gpu_wire.py tests/integration/test_p2p.py 2>&1 | tee "$OUT/pytest.log" | tail -25 || status=1
timeout 150 python3 benchmarks/gpu.py 2>&1 | tee "$OUT/bench.log" | tail -22 || status=1
# S3 (400 KiB same node, CPU path) on a machine quieter than the 2-vCPU VMs (issue #4).
timeout 90 python3 benchmarks/transfer.py --size "400 KiB" 2>&1 | tee "$OUT/transfer.log" | tail -12 || status=1
exit $status
