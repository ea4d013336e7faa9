#!/usr/bin/env bash
# A CPU benchmark on a many-core host that runs commands under a time limit: bench/run.py with --jobs, stopped
# cleanly before the limit, its run directories packed into $OUT (results.tgz). Calling it again resumes every run.
#
#   with the wheels in .whl and earlier results in .device/:
#       bash tools/device/device_bench.sh 530 configs/minilm-cpu.yaml --strategies int8 fp32 ppo random greedy optuna \
#           --seeds 0 1 2 --budget 150 --out bench/results/minilm-cpu --jobs 11 --cores-per-job 2
#
# The first argument is the seconds the benchmark may run in this call; the rest go to bench/run.py.
# On a fresh machine (a later session), RESUME_FROM=FILE.tgz first unpacks the results.tgz an earlier call
# returned (kept under .device/, which is carried), so every run continues where it stopped.
set -uo pipefail
cd "$(dirname "$0")/../.."
seconds=$1
shift
bash tools/device/device_wheels.sh install >/dev/null
if [[ -n "${RESUME_FROM:-}" ]]; then tar xzf "$RESUME_FROM"; fi
export PYTHONPATH=$PWD/.device/site:$PWD AUTOTUNE_MINILM_DIR=$PWD/.device/minilm MPLBACKEND=Agg
out=${OUT:-/tmp/out}
mkdir -p "$out"
{ echo "cwd $PWD"; nproc; lscpu | grep -E "Model name|Thread|Core|Socket|NUMA node[0-9]"; python -c \
    "import onnxruntime, torch; print('onnxruntime', onnxruntime.__version__, 'torch', torch.__version__)"; } \
    | tee "$out/machine.txt"
timeout -s INT "$seconds" python bench/run.py "$@" >"$out/bench.log" 2>&1
echo "bench exit $?"
results=$(python -c 'import sys; a = sys.argv[1:]; print(a[a.index("--out") + 1])' "$@")
tar czf "$out/results.tgz" --exclude='*.onnx' --exclude='*.pt2' "$results"
tail -n 40 "$out/bench.log"
python - "$results" <<'PY'
import sqlite3, sys
from pathlib import Path
for store in sorted(Path(sys.argv[1]).glob("runs/*/trials.sqlite")):
    count = sqlite3.connect(store).execute("select count(*) from trials").fetchone()[0]
    print(store.parent.name, count, "trials", "done" if (store.parent / "summary.json").exists() else "")
PY
