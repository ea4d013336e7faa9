#!/usr/bin/env bash
# Tuning runs on a bare GPU machine, through `python bench/gpu.py tune`: the wheels in .whl installed offline,
# MiniLM's weights from .device/minilm, every run directory written to $OUT/runs (exported weights left out to keep
# the transfer small), each run's log to $OUT/<name>.log, and the rows of every run to $OUT/gpu.json and gpu.md.
#
#   bash tools/device/device_tune.sh SECONDS CONFIG [--set KEY=VALUE ...] [-- CONFIG [--set KEY=VALUE ...] ...]
#   e.g. bash tools/device/device_tune.sh 550 configs/minilm-gpu-b64.yaml --set budget.builds=8 \
#            -- configs/minilm-gpu-b256.yaml --set budget.builds=8
#
# SECONDS is now one time limit for all the runs together (gpu.py's --time-limit), no longer one before each config:
# each run gets what the runs before it left, and no run starts after it. A run cut by the limit keeps its trials
# (SIGINT, as Ctrl-C); `autotune resume` continues it.
set -uo pipefail
cd "$(dirname "$0")/../.."
bash tools/device/device_wheels.sh install >/dev/null
export PYTHONPATH=$PWD/.device/site:$PWD AUTOTUNE_MINILM_DIR=$PWD/.device/minilm MPLBACKEND=Agg
out=${OUT:-/tmp/out}
seconds=$1
shift
python bench/gpu.py tune --out "$out" --time-limit "$seconds" "$@"
echo "== bench/gpu.py tune: exit $?"
if [[ -d "$out/runs" ]]; then find "$out/runs" \( -name '*.pt2' -o -name '*.pt' -o -name '*.onnx' \) -delete; fi
