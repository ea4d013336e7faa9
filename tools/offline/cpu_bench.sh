#!/usr/bin/env bash
# A CPU benchmark (bench/run.py) on a many-core server without network access, under a time limit.
set -uo pipefail

usage() {
    cat <<'USAGE'
usage: bash tools/offline/cpu_bench.sh [--dry-run] SECONDS BENCH_ARGS ...

On a server without network access, in a copy of the checkout that holds .whl/ and .device/minilm from
tools/offline/prepare.sh: installs the wheels (tools/offline/install.sh), then runs bench/run.py BENCH_ARGS for
at most SECONDS, stopped cleanly (SIGINT) at the limit. Its run directories are packed into $OUT/results.tgz
(default OUT runs/offline, under the repository root, exported models left out), with the machine's description in machine.txt and the log in
bench.log. Calling it again resumes every run; on a fresh copy, RESUME_FROM=FILE.tgz first unpacks the
results.tgz an earlier call wrote.

  e.g. bash tools/offline/cpu_bench.sh 530 configs/minilm-cpu.yaml --strategies int8 fp32 ppo random greedy optuna \
           --seeds 0 1 2 --budget 150 --out bench/results/minilm-cpu --jobs 11 --cores-per-job 2

Options:
  --dry-run   print the commands, run nothing
  -h, --help  this text
USAGE
}

dry_run=0
case "${1:-}" in
    -h | --help) usage; exit 0 ;;
    --dry-run) dry_run=1; shift ;;
esac
if (($# < 2)) || [[ " $* " != *" --out "* ]]; then
    echo "cpu_bench.sh: give SECONDS and bench/run.py's arguments, --out among them" >&2
    usage >&2
    exit 2
fi
cd "$(dirname "$0")/../.."  # the repository root, wherever this is called from
seconds=$1
shift
out=${OUT:-runs/offline}
results=$(python3 -c 'import sys; a = sys.argv[1:]; print(a[a.index("--out") + 1])' "$@")
if ((dry_run)); then
    echo "bash tools/offline/install.sh"
    if [[ -n "${RESUME_FROM:-}" ]]; then echo "tar xzf $RESUME_FROM"; fi
    echo "timeout -s INT $seconds python bench/run.py $* > $out/bench.log"
    echo "tar czf $out/results.tgz $results"
    exit 0
fi
bash tools/offline/install.sh >/dev/null || exit 1
if [[ -n "${RESUME_FROM:-}" ]]; then tar xzf "$RESUME_FROM"; fi
export PYTHONPATH=$PWD/.device/site:$PWD AUTOTUNE_MINILM_DIR=$PWD/.device/minilm MPLBACKEND=Agg
mkdir -p "$out"
{ echo "cwd $PWD"; nproc; lscpu | grep -E "Model name|Thread|Core|Socket|NUMA node[0-9]"; python -c \
    "import onnxruntime, torch; print('onnxruntime', onnxruntime.__version__, 'torch', torch.__version__)"; } \
    | tee "$out/machine.txt"
timeout -s INT "$seconds" python bench/run.py "$@" >"$out/bench.log" 2>&1
echo "bench exit $?"
tar czf "$out/results.tgz" --exclude='*.onnx' --exclude='*.pt2' "$results"
tail -n 40 "$out/bench.log"
python - "$results" <<'PY'
import sqlite3, sys
from pathlib import Path
for store in sorted(Path(sys.argv[1]).glob("runs/*/trials.sqlite")):
    count = sqlite3.connect(store).execute("select count(*) from trials").fetchone()[0]
    print(store.parent.name, count, "trials", "done" if (store.parent / "summary.json").exists() else "")
PY
