r"""Uniform plans (all-FP32, all-FP16, ... all-INT8) of each GPU config, measured in one call on the GPU machine.

Usage (on the GPU machine, from the repository root, after ``bash bench/device_wheels.sh install``):
    PYTHONPATH=.device/site:. python bench/gpu.py configs/minilm-gpu.yaml configs/minilm-gpu-b1.yaml \
        configs/cnn-gpu.yaml --plans fp32 fp16 bf16 int8 fp8 --minilm-dir .device/minilm --out $OUT

Per config, one ``Evaluator`` prepares the model, calibration and FP32 reference once in its trial process; each
plan is then built and measured on the held-out split with the config's confirmation protocol (the FP32
reference timed interleaved, in the same process). A precision the space does not offer a layer leaves that
layer FP32 (``SearchSpace.uniform``); a plan that changes no layer is reported as ``unchanged`` and not built.

Writes ``gpu_results.json`` and ``gpu_results.md`` into ``--out`` after every plan, so a killed call keeps what
it measured; ``--time-limit`` stops starting new work in time to finish inside a call's limit. A failure of a
config or a plan is a row with its error, never a crash of the script.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8")
UNCHANGED = "unchanged"
SKIPPED = "skipped"
ERROR = "error"
RESULT_FIELDS = (
    "latency_ms",
    "latency_iqr_ms",
    "reference_latency_ms",
    "reference_latency_iqr_ms",
    "speedup",
    "accuracy",
    "reference_accuracy",
    "accuracy_drop",
    "build_s",
    "total_s",
    "protocol",
    "split",
)


def use_repository_paths() -> None:
    """Puts the repository and the wheels unpacked by ``device_wheels.sh install`` first on the import path.

    The GPU machine has no installed autotune. The trial processes the evaluator spawns get the same path: spawn
    passes ``sys.path`` on, and ``PYTHONPATH`` covers any other child.
    """
    paths = [str(path) for path in (ROOT / ".device" / "site", ROOT) if path.is_dir()]
    sys.path[:0] = [path for path in paths if path not in sys.path]
    inherited = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path and path not in paths]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + inherited)


def log(message: str, started: float) -> None:
    """One progress line with the seconds since the start, flushed so a captured log shows where the run is."""
    print(f"[gpu {time.perf_counter() - started:7.1f} s] {message}", flush=True)


def environment() -> dict[str, Any]:
    """The machine and library versions the numbers belong to; what cannot be read is recorded as its error."""
    info: dict[str, Any] = {
        "host": platform.node(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "minilm_dir": os.environ.get("AUTOTUNE_MINILM_DIR"),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            info["device"] = torch.cuda.get_device_name(0)
            info["compute_capability"] = f"{major}.{minor}"
            info["device_count"] = torch.cuda.device_count()
    except Exception as error:  # noqa: BLE001 - the environment is reported, not required
        info["torch_error"] = f"{type(error).__name__}: {error}"
    for module in ("transformers", "onnx", "onnxruntime", "numpy"):
        try:
            info[module] = __import__(module).__version__
        except Exception as error:  # noqa: BLE001
            info[module] = f"unavailable ({type(error).__name__})"
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        info["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
    return info


def _first_line(text: str | None, limit: int = 160) -> str:
    """The last non-empty line of an error (a traceback's message), cut for a table cell."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _number(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(results: dict[str, Any]) -> str:
    """The results as markdown: what was measured where, then one row per config and plan.

    Args:
        results: What :func:`main` writes to ``gpu_results.json``: ``environment``, ``command``, ``rows``.

    Returns:
        The markdown text.
    """
    env = results.get("environment", {})
    device = env.get("device") or "no CUDA device"
    lines = [
        f"Measured {results.get('date', '?')} on {device} (compute capability {env.get('compute_capability', '?')}, "
        f"driver {env.get('driver') or '?'}), torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}, "
        f"Python {env.get('python', '?')}, transformers {env.get('transformers', '?')}.",
        "",
        f"Command: `{results.get('command', '')}`",
        "",
        "Held-out split; latency median (IQR) in ms, the FP32 reference timed interleaved in the same process; "
        "speedup is the median of per-round ratios; drop is the reference's metric minus the plan's.",
        "",
        "| config | plan | layers changed | status | latency ms | FP32 ms | speedup | accuracy | drop | budget "
        "| cosine | top-1 agr. | SNR dB | build s | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results.get("rows", []):
        fidelity = row.get("fidelity") or {}
        latency = row.get("latency_ms")
        reference = row.get("reference_latency_ms")
        latency_cell = "-" if latency is None else f"{latency:.4f} ({_number(row.get('latency_iqr_ms'), '.4f')})"
        reference_cell = (
            "-" if reference is None else f"{reference:.4f} ({_number(row.get('reference_latency_iqr_ms'), '.4f')})"
        )
        speedup = row.get("speedup")
        changed = row.get("layers_changed")
        note = _first_line(row.get("error")) or row.get("note") or ""
        budget = row.get("accuracy_budget")
        within = row.get("within_budget")
        budget_cell = "-" if budget is None or within is None else f"{budget:g} {'yes' if within else 'NO'}"
        lines.append(
            "| "
            + " | ".join(
                [
                    str(row.get("config", "?")),
                    str(row.get("plan", "?")),
                    "-" if changed is None else f"{changed}/{row.get('layers', '?')}",
                    str(row.get("status", "?")),
                    latency_cell,
                    reference_cell,
                    "-" if speedup is None else f"{speedup:.2f}x",
                    _number(row.get("accuracy"), ".5f"),
                    _number(row.get("accuracy_drop"), ".5f"),
                    budget_cell,
                    _number(fidelity.get("cosine"), ".6f"),
                    _number(fidelity.get("top1_agreement"), ".4f"),
                    _number(fidelity.get("snr_db"), ".1f"),
                    _number(row.get("build_s"), ".1f"),
                    note.replace("|", "\\|"),
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def write(results: dict[str, Any], out: Path) -> None:
    """Writes ``gpu_results.json`` and ``gpu_results.md``, each replaced whole so a kill never leaves half a file."""
    for name, text in (
        ("gpu_results.json", json.dumps(results, indent=2, default=str)),
        ("gpu_results.md", markdown(results)),
    ):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)


def base_row(config_name: str, spec: str, status: str, error: str | None = None, **extra: Any) -> dict[str, Any]:
    """A results row before anything is measured."""
    return {"config": config_name, "plan": spec, "status": status, "error": error, **extra}


def plan_row(config_name: str, spec: str, plan: Any, result: Any, accuracy_budget: float) -> dict[str, Any]:
    """A results row from a measured plan (``TrialResult``)."""
    row = base_row(config_name, spec, result.status, result.error)
    row.update(plan_fields(plan))
    row.update({name: getattr(result, name) for name in RESULT_FIELDS})
    row["fidelity"] = dict(result.fidelity)
    row["accuracy_budget"] = accuracy_budget
    drop = result.accuracy_drop
    row["within_budget"] = None if drop is None else bool(drop <= accuracy_budget)
    return row


def plan_fields(plan: Any) -> dict[str, Any]:
    """What a plan changes: layers off FP32, its precisions, knobs, hash and one-line summary."""
    precisions = plan.precision_map
    counts: dict[str, int] = {}
    for precision in precisions.values():
        counts[precision] = counts.get(precision, 0) + 1
    return {
        "plan_hash": plan.hash,
        "plan_summary": plan.describe(),
        "layers": len(precisions),
        "layers_changed": sum(1 for precision in precisions.values() if precision != "fp32"),
        "precision_counts": counts,
        "knobs": plan.knob_map,
    }


def parse_knobs(items: list[str]) -> dict[str, Any]:
    """``name=value`` pairs (values parsed as YAML: ``true``, ``ATEN,TRITON``) into a dict.

    Raises:
        ValueError: An item is not ``name=value``.
    """
    import yaml

    knobs = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--knob {item!r} must look like name=value")
        name, raw = item.split("=", 1)
        knobs[name.strip()] = yaml.safe_load(raw)
    return knobs


def run_config(
    config_path: str, specs: list[str], args: argparse.Namespace, results: dict[str, Any], started: float
) -> None:
    """Measures every plan of one config, appending a row per plan to ``results`` and writing it out."""
    from autotune.api import analyze, resolve_plan
    from autotune.config import load_config
    from autotune.harness import Evaluator
    from autotune.harness.runner import confirmation_protocol
    from autotune.store import TrialStore

    rows = results["rows"]
    name = Path(config_path).stem

    def out_of_time() -> bool:
        return args.time_limit is not None and time.perf_counter() - started > args.time_limit

    def fail_all(status: str, error: str) -> None:
        for spec in specs:
            rows.append(base_row(name, spec, status, error))
        write(results, args.out)

    if out_of_time():
        fail_all(SKIPPED, f"--time-limit {args.time_limit:.0f} s reached before this config started")
        return
    setup_started = time.perf_counter()
    try:
        config = load_config(config_path, [f"runs_dir={args.out / 'runs'}", *args.set])
        name = config.name
        log(f"{name}: analysing the model", started)
        model, space = analyze(config, profile=False)
        knobs = parse_knobs(args.knob)
        log(f"{name}: {len(model.layers)} layers, {len(space.searchable)} searchable; preparing the evaluator", started)
        store = TrialStore(config.run_dir / "gpu.sqlite")
    except Exception as error:  # noqa: BLE001 - a config that cannot start is a row per plan, not a crash
        log(f"{name}: setup failed: {_first_line(str(error))}", started)
        fail_all(ERROR, f"setup: {type(error).__name__}: {error}\n{traceback.format_exc()}")
        return
    protocol = confirmation_protocol(config)
    results["configs"][name] = {
        "path": str(config_path),
        "layers": len(model.layers),
        "searchable": len(space.searchable),
        "choices": {layer.name: list(options) for layer, options in zip(space.layers, space.choices, strict=True)},
        "accuracy_budget": config.accuracy_budget,
        "metric": config.metric.name,
        "protocol": protocol.to_dict(),
        "inputs": [spec.model_dump() for spec in config.inputs],
    }
    try:
        evaluator = Evaluator(config, store)
    except Exception as error:  # noqa: BLE001
        log(f"{name}: the evaluator failed to start: {_first_line(str(error))}", started)
        results["configs"][name]["setup_error"] = f"{type(error).__name__}: {error}"
        store.close()
        fail_all(ERROR, f"evaluator setup: {type(error).__name__}: {error}")
        return
    results["configs"][name]["setup_s"] = time.perf_counter() - setup_started
    log(f"{name}: ready after {results['configs'][name]['setup_s']:.1f} s", started)
    try:
        for spec in specs:
            if out_of_time():
                rows.append(base_row(name, spec, SKIPPED, f"--time-limit {args.time_limit:.0f} s reached"))
                write(results, args.out)
                continue
            try:
                plan = resolve_plan(spec, space)
                if knobs:
                    plan = plan.with_knobs(**knobs)
            except Exception as error:  # noqa: BLE001
                rows.append(base_row(name, spec, ERROR, f"plan: {type(error).__name__}: {error}"))
                write(results, args.out)
                continue
            fields = plan_fields(plan)
            if fields["layers_changed"] == 0 and spec != "fp32":
                # Nothing to build: the plan would only re-measure FP32 (no layer of this model offers the precision).
                note = f"no layer of this model offers {spec} on this backend: the plan is all-FP32"
                rows.append(base_row(name, spec, UNCHANGED, None, note=note, **fields))
                log(f"{name} {spec}: unchanged ({note})", started)
                write(results, args.out)
                continue
            log(f"{name} {spec}: building and measuring ({plan.describe()[:100]})", started)
            try:
                result = evaluator.measure(plan, "holdout", protocol)
                store.put(result)
                row = plan_row(name, spec, plan, result, config.accuracy_budget)
            except Exception as error:  # noqa: BLE001 - the store or the pipe failed: still a row
                row = base_row(name, spec, ERROR, f"{type(error).__name__}: {error}", **fields)
            rows.append(row)
            write(results, args.out)
            if row["status"] == "ok":
                log(
                    f"{name} {spec}: {row['latency_ms']:.4f} ms vs FP32 {row['reference_latency_ms']:.4f} ms "
                    f"({row['speedup']:.2f}x), drop {row['accuracy_drop']:.5f}, build {row['build_s']:.1f} s",
                    started,
                )
            else:
                log(f"{name} {spec}: {row['status']}: {_first_line(row['error'])}", started)
    finally:
        evaluator.close()
        store.close()


def main(argv: list[str] | None = None) -> int:
    """Measures the plans of every config; writes gpu_results.json and gpu_results.md into --out."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", help="config YAML files (backend torch)")
    parser.add_argument("--plans", nargs="+", default=list(PRECISIONS), help="fp32, fp16, bf16, int8, fp8 or plan JSON")
    parser.add_argument("--out", type=Path, required=True, help="folder for the results and the run stores")
    parser.add_argument("--set", action="append", default=[], help="config override for every config (key=value)")
    parser.add_argument("--knob", action="append", default=[], help="knob for every plan, e.g. tf32=true")
    parser.add_argument("--minilm-dir", type=Path, help="sets AUTOTUNE_MINILM_DIR (a folder written by minilm pack)")
    parser.add_argument(
        "--time-limit", type=float, help="seconds after which no new config or plan is started (a call's limit)"
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    use_repository_paths()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.minilm_dir is not None:
        os.environ["AUTOTUNE_MINILM_DIR"] = str(args.minilm_dir.resolve())  # inherited by the trial processes
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python "
        + " ".join(shlex.quote(a) for a in (sys.argv if argv is None else ["bench/gpu.py", *argv])),
        "plans": args.plans,
        "overrides": args.set,
        "knobs": args.knob,
        "environment": environment(),
        "configs": {},
        "rows": [],
    }
    env = results["environment"]
    log(
        f"{env.get('device', 'no CUDA device')} (cc {env.get('compute_capability', '?')}), torch {env.get('torch')}, "
        f"CUDA {env.get('cuda')}",
        started,
    )
    write(results, args.out)
    for config_path in args.configs:
        try:
            run_config(config_path, args.plans, args, results, started)
        except Exception as error:  # noqa: BLE001 - last resort: the next config still runs
            results["rows"].append(base_row(Path(config_path).stem, "*", ERROR, traceback.format_exc()))
            log(f"{config_path}: {type(error).__name__}: {error}", started)
    results["wall_s"] = time.perf_counter() - started
    write(results, args.out)
    log(f"done; wrote {args.out / 'gpu_results.json'} and gpu_results.md", started)
    print(markdown(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
