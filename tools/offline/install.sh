#!/usr/bin/env bash
# Installs the wheels prepare.sh downloaded, on a GPU server without network access.
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: bash tools/offline/install.sh [--dry-run]

On a GPU server without network access, in a copy of the checkout that holds the .whl/ folder written by
tools/offline/prepare.sh: installs those wheels into .device/site, offline and without resolving dependencies
(the server's own torch, numpy and the rest stay as they are), and compiles their bytecode. Then run with

  PYTHONPATH=.device/site:. AUTOTUNE_MINILM_DIR=.device/minilm python -m autotune tune configs/minilm-gpu.yaml
  PYTHONPATH=.device/site:. python bench/gpu.py tune --out OUT configs/minilm-gpu.yaml

or with tools/offline/gpu_tune.sh, which calls this script first.

Options:
  --dry-run   print the wheels and where they would go, install nothing
  -h, --help  this text

Environment: PYTHON, the server's interpreter (default python3).
USAGE
}

dry_run=0
for arg in "$@"; do
    case "$arg" in
        -h | --help) usage; exit 0 ;;
        --dry-run) dry_run=1 ;;
        *) echo "install.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
    esac
done

cd "$(dirname "$0")/../.."  # the repository root, wherever this is called from
WHEELS=.whl
SITE=.device/site
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if ((${#wheels[@]} == 0)); then
    echo "install.sh: no wheels in $PWD/$WHEELS: run tools/offline/prepare.sh where there is a network, and copy .whl/ here" >&2
    exit 1
fi
if ((dry_run)); then
    echo "would install ${#wheels[@]} wheels into $SITE with $PYTHON:"
    printf '  %s\n' "${wheels[@]}"
    exit 0
fi

rm -rf "$SITE"
mkdir -p "$SITE"
if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$SITE" "${wheels[@]}"
else
    # A wheel is a zip of its site-packages files: unpacking one is installing it (none of these has scripts).
    for wheel in "${wheels[@]}"; do "$PYTHON" -m zipfile -e "$wheel" "$SITE"; done
fi
# Bytecode, as pip writes it at install: where PYTHONDONTWRITEBYTECODE is set, every process would otherwise compile
# torchao's and the checkout's sources again.
"$PYTHON" -m compileall -q -j 0 "$SITE" autotune >/dev/null 2>&1 || true
echo "installed ${#wheels[@]} wheels into $SITE; run with PYTHONPATH=$SITE:."
