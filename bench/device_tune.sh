#!/usr/bin/env bash
# Tuning runs on a bare GPU machine, each under its own time limit: the wheels in .whl installed offline, MiniLM's
# weights from .device/minilm, every run directory written to $OUT/runs (exported weights left out to keep the
# transfer small), each run's log to $OUT/<name>.log.
#
#   bash bench/device_tune.sh SECONDS CONFIG [--set KEY=VALUE ...] [-- SECONDS CONFIG [--set ...] ...]
#   e.g. bash bench/device_tune.sh 250 configs/minilm-gpu-b64.yaml --set budget.builds=8 \
#            -- 300 configs/minilm-gpu-b256.yaml --set budget.builds=8
#
# A run cut by its limit keeps its trials (SIGINT, as Ctrl-C); `autotune resume` continues it.
set -uo pipefail
cd "$(dirname "$0")/.."
bash bench/device_wheels.sh install >/dev/null
export PYTHONPATH=$PWD/.device/site:$PWD AUTOTUNE_MINILM_DIR=$PWD/.device/minilm MPLBACKEND=Agg
out=${OUT:-/tmp/out}
mkdir -p "$out/runs"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } | tee "$out/machine.txt"
while (($#)); do
    seconds=$1 config=$2
    shift 2
    args=()
    while (($#)) && [[ $1 != -- ]]; do args+=("$1"); shift; done
    (($#)) && shift
    name=$(basename "$config" .yaml)
    started=$SECONDS
    timeout -s INT "$seconds" python -m autotune tune "$config" --set "runs_dir=$out/runs" "${args[@]}" \
        --no-progress >"$out/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - started)) s"
    tail -n 40 "$out/$name.log"
done
find "$out/runs" \( -name '*.pt2' -o -name '*.pt' -o -name '*.onnx' \) -delete
