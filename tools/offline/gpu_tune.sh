#!/usr/bin/env bash
# Tuning runs on a GPU server without network access, through `python bench/gpu.py tune`, under one time limit.
set -uo pipefail

usage() {
    cat <<'USAGE'
usage: bash tools/offline/gpu_tune.sh [--dry-run] SECONDS CONFIG [--set KEY=VALUE ...] [-- CONFIG [--set ...] ...]

On a GPU server without network access, in a copy of the checkout that holds .whl/ and .device/minilm from
tools/offline/prepare.sh: installs the wheels (tools/offline/install.sh), then runs `python bench/gpu.py tune`
on each config, MiniLM's weights read from .device/minilm. SECONDS is one time limit for all the runs together:
each run gets what the runs before it left, and none starts after it; a run stopped by the limit keeps its trials
(SIGINT, as Ctrl-C) and `autotune resume` continues it.

Writes into $OUT (default runs/offline, under the repository root): every run directory under runs/ (exported weights left out, to keep the
folder small to copy back), each run's log as <name>.log, and the rows of every run in gpu.json and gpu.md.

  e.g. bash tools/offline/gpu_tune.sh 550 configs/minilm-gpu-b64.yaml --set budget.builds=8 \
           -- configs/minilm-gpu-b256.yaml --set budget.builds=8

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
if (($# < 2)); then
    usage >&2
    exit 2
fi
cd "$(dirname "$0")/../.."  # the repository root, wherever this is called from
out=${OUT:-runs/offline}
seconds=$1
shift
if ((dry_run)); then
    echo "bash tools/offline/install.sh"
    echo "PYTHONPATH=$PWD/.device/site:$PWD AUTOTUNE_MINILM_DIR=$PWD/.device/minilm" \
        "python bench/gpu.py tune --out $out --time-limit $seconds $*"
    exit 0
fi
bash tools/offline/install.sh >/dev/null || exit 1
export PYTHONPATH=$PWD/.device/site:$PWD AUTOTUNE_MINILM_DIR=$PWD/.device/minilm MPLBACKEND=Agg
python bench/gpu.py tune --out "$out" --time-limit "$seconds" "$@"
echo "== bench/gpu.py tune: exit $?"
if [[ -d "$out/runs" ]]; then find "$out/runs" \( -name '*.pt2' -o -name '*.pt' -o -name '*.onnx' \) -delete; fi
