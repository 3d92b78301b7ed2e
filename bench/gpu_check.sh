#!/usr/bin/env bash
# The GPU check as one command (make gpu-check): bench/gpu_check.py on a machine that has torch
# but neither scaletrain installed nor network. scaletrain runs from src/ (PYTHONPATH); pydantic
# and blake3, which such a machine may lack, are installed from the wheels in .whl/ (make
# gpu-wheels, on a machine with network). Arguments go to bench/gpu_check.py:
#
#   bash bench/gpu_check.sh --out "$OUT/gpu.json"
#   bash bench/gpu_check.sh --device cpu --only determinism
set -euo pipefail
cd "$(dirname "$0")/.."

if ! python3 -c 'import pydantic, blake3' 2>/dev/null; then
    shopt -s nullglob
    wheels=(.whl/*.whl)
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "error: pydantic or blake3 is not installed and .whl/ has no wheels: run 'make gpu-wheels' on a machine with network, then copy .whl/ here" >&2
        exit 2
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec python3 bench/gpu_check.py "$@"
