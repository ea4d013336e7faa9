"""tools/offline/: the offline install's scripts run from any working directory, with --help and a dry run."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OFFLINE = ROOT / "tools" / "offline"
SCRIPTS = ["prepare.sh", "install.sh", "gpu_tune.sh", "cpu_bench.sh"]


def run(script, *args, cwd, env=None):
    return subprocess.run(
        ["bash", str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=60, env=env, check=False
    )


def test_the_folder_holds_the_scripts_the_docs_name():
    assert sorted(p.name for p in OFFLINE.glob("*.sh")) == sorted(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_help_works_from_the_repository_root_and_from_any_other_folder(script, where, tmp_path):
    cwd = ROOT if where == "root" else tmp_path
    path = Path("tools/offline") / script if where == "root" else OFFLINE / script
    done = run(path, "--help", cwd=cwd)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: bash tools/offline/{script}")
    assert "--dry-run" in done.stdout and "network" in done.stdout
    assert list(tmp_path.iterdir()) == []  # --help wrote nothing


def test_an_unknown_argument_is_one_line_naming_help(tmp_path):
    done = run(OFFLINE / "install.sh", "--bogus", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip() == "install.sh: unknown argument --bogus (see --help)"


def test_the_dry_runs_of_the_runs_name_the_repositorys_paths_from_another_folder(tmp_path):
    done = run(OFFLINE / "gpu_tune.sh", "--dry-run", "60", "configs/minilm-gpu.yaml", "--set", "a=1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"PYTHONPATH={ROOT}/.device/site:{ROOT} " in done.stdout
    expected = "python bench/gpu.py tune --out runs/offline --time-limit 60 configs/minilm-gpu.yaml --set a=1"
    assert expected in done.stdout
    done = run(OFFLINE / "cpu_bench.sh", "--dry-run", "60", "configs/cnn-cpu.yaml", "--out", "results", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "timeout -s INT 60 python bench/run.py configs/cnn-cpu.yaml --out results" in done.stdout
    assert run(OFFLINE / "cpu_bench.sh", "60", "configs/cnn-cpu.yaml", cwd=tmp_path).returncode == 2  # no --out
    assert run(OFFLINE / "gpu_tune.sh", "60", cwd=tmp_path).returncode == 2  # no config


def test_install_finds_the_wheels_at_the_repository_root_wherever_it_is_called_from(tmp_path):
    copy = tmp_path / "checkout"
    (copy / "tools" / "offline").mkdir(parents=True)
    shutil.copy(OFFLINE / "install.sh", copy / "tools" / "offline")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = run(copy / "tools" / "offline" / "install.sh", "--dry-run", cwd=elsewhere)
    assert done.returncode == 1 and "no wheels in" in done.stderr and "prepare.sh" in done.stderr
    (copy / ".whl").mkdir()
    (copy / ".whl" / "tiny-1.0-py3-none-any.whl").write_bytes(b"")
    done = run(copy / "tools" / "offline" / "install.sh", "--dry-run", cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    assert "would install 1 wheels into .device/site" in done.stdout and ".whl/tiny-1.0-py3-none-any.whl" in done.stdout
    assert not (copy / ".device").exists()


def test_prepare_dry_run_lists_the_pinned_wheels_and_the_minilm_folder(tmp_path):
    import os

    env = {**os.environ, "PYTHON": sys.executable}
    done = run(OFFLINE / "prepare.sh", "--dry-run", cwd=tmp_path, env=env)
    if done.returncode == 1 and "is not installed" in done.stderr:
        pytest.skip(done.stderr.strip())  # an environment without the optional extras the wheels pin
    assert done.returncode == 0, done.stderr
    assert "pydantic==" in done.stdout and "stable-baselines3==" in done.stdout
    assert "-m autotune.examples.minilm pack .device/minilm" in done.stdout
    assert "minilm" not in run(OFFLINE / "prepare.sh", "--dry-run", "--no-minilm", cwd=tmp_path, env=env).stdout
