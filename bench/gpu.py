r"""The GPU bench: tuning runs and plans against the users' one-liners, and the GEMM kernels beneath them.

Usage (on the GPU machine, from the repository root; on a server without network access after
``bash tools/offline/install.sh``, with ``PYTHONPATH=.device/site:.``):
    python bench/gpu.py tune --out OUT [--time-limit S] CONFIG [--set KEY=VALUE ...] [-- CONFIG [--set ...] ...]
    python bench/gpu.py plans --out OUT CONFIG --plans SPEC ... [--set KEY=VALUE ...] [--references NAME ...]
    python bench/gpu.py gemm --out OUT [--repeats N]
    python bench/gpu.py table --out OUT RUN_DIR_OR_SUMMARY_JSON ...

``tune``: per config, ``python -m autotune tune CONFIG --set runs_dir=OUT/runs --no-progress [--set ...]``, its
log in ``OUT/<name>.log``, stopped as by ``timeout -s INT`` at what is left of ``--time-limit``; from its
``summary.json`` and trial store: FP32, the one-liners and the winner in both timings (one launch at a time;
launches back to back), the winner over the fastest one-liner within the accuracy budget
(``autotune.run.trial.ratio``), the set-up seconds and the builds.

``plans``: a ``TrialRunner`` in this process builds the plans of the specs and the backend's one-liners and times
them side by side against FP32 on the held-out split with the confirmation protocol, back to back too
(``TrialRunner.run_side_by_side``); the winner is the fastest plan within the budget. A spec is
``PRECISION[@REGEX][:knob=value,...]`` or a plan ``.json`` file (see ``resolve``); e.g. every Linear in torchao's
FP8: ``fp8:base_precision=bf16,attention=sdpa`` with ``--set backend.options.quantized_gemm=torchao``.

``gemm``: per (M, K, N), each kernel in a CUDA graph: BF16 ``torch.mm``; FP8 ``torch._scaled_mm`` rowwise and
tensorwise, and rowwise behind the static activation quantization (what a layer pays when nothing fuses it); INT8
``torch._int_mm``, alone and behind the quantization; each as BF16 ms over its ms (above 1: faster than BF16).

``table``: ``tune``'s table of runs already made, from their run directories or kept ``summary.json`` files (the
build times need the run directory's store).

Each writes ``gpu.json`` and ``gpu.md`` into ``--out`` after every row, each replaced whole, so a killed call
keeps what it measured; ``--time-limit`` stops starting new work; a failure is a row with its error. MiniLM's
configs read the weights from ``AUTOTUNE_MINILM_DIR`` (``.device/minilm`` on the GPU machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GEMM_M = (1024, 8192, 32768)  # rows: batch x 128 tokens at batch 8, 64 and 256
# (K, N): MiniLM's attention and FFN GEMMs (hidden 384, FFN 1536), BERT-large's (1024, 4096), and a square 4096
GEMM_KN = ((384, 384), (384, 1536), (1536, 384), (1024, 1024), (1024, 4096), (4096, 1024), (4096, 4096))
GEMM_KERNELS = ("bf16", "fp8_rowwise_gemm", "fp8_rowwise_quant", "fp8_tensorwise_gemm", "int8_gemm", "int8_quant")
COMPILE_STAGES = ("compile", "first_call")  # build stages that compile: dynamo and inductor in torch's first call
STARTED = time.perf_counter()  # for the progress lines


def use_repository_paths() -> None:
    """Puts the repository and ``tools/offline/install.sh``'s wheels first on the path, children's too."""
    paths = [str(path) for path in (ROOT / ".device" / "site", ROOT) if path.is_dir()]
    sys.path[:0] = [path for path in paths if path not in sys.path]
    inherited = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path and path not in paths]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + inherited)


def log(message: str) -> None:
    """One progress line with the seconds since the start, flushed so a captured log shows where the call is."""
    print(f"[gpu {time.strftime('%H:%M:%S')} {time.perf_counter() - STARTED:7.1f} s] {message}", flush=True)


def time_left(args: argparse.Namespace) -> float:
    """Seconds left of ``--time-limit`` since ``args.started`` (infinite without one); at 0 no new work starts."""
    return math.inf if args.time_limit is None else args.time_limit - (time.perf_counter() - args.started)


def environment() -> dict[str, Any]:
    """The machine and library versions the numbers belong to; what cannot be read is recorded as its error."""
    info: dict[str, Any] = {"host": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count()}
    info["minilm_dir"] = os.environ.get("AUTOTUNE_MINILM_DIR")  # which MiniLM weights the numbers are of
    for module in ("torch", "torchao", "transformers", "numpy"):
        try:
            info[module] = __import__(module).__version__
        except Exception as error:  # noqa: BLE001 - the environment is reported, not required
            info[module] = f"unavailable ({type(error).__name__})"
    try:
        import torch

        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["device"] = torch.cuda.get_device_name(0)
            info["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        info["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip() or None
    except Exception as error:  # noqa: BLE001 - no torch, or no nvidia-smi
        info["probe_error"] = f"{type(error).__name__}: {error}"
    return info


def parse_knobs(items: list[str]) -> dict[str, Any]:
    """``name=value`` pairs (values parsed as YAML: ``true``, ``ATEN,TRITON``) into a dict.

    Raises:
        ValueError: An item is not ``name=value``.
    """
    import yaml

    if malformed := [item for item in items if "=" not in item]:
        raise ValueError(f"knobs {malformed} must look like name=value")
    return {name.strip(): yaml.safe_load(raw) for name, raw in (item.split("=", 1) for item in items)}


def resolve(spec: str, space: Any) -> Any:
    """The plan of a spec ``PRECISION[@REGEX][:knob=value,...]``, or of a plan ``.json`` file.

    The layers matching ``REGEX`` (all when left out) take ``PRECISION``, the others the plan's ``base_precision``
    (a uniform plan's is ``PRECISION`` where the space offers it: ``SearchSpace.uniform``).

    Raises:
        ValueError: An unknown precision, or a plan outside the space.
    """
    from autotune.plan import PRECISIONS, Plan

    if spec.endswith(".json"):  # a plan file: the plan.json of a run's exported winner
        stored = Plan.from_json(Path(spec).read_text())
        plan = space.plan(stored.precision_map, stored.knob_map)
    else:
        head, _, knob_text = spec.partition(":")
        precision, _, pattern = head.partition("@")
        if precision not in PRECISIONS:  # else every layer would quietly stay FP32
            raise ValueError(f"unknown precision {precision!r}; precisions: {', '.join(PRECISIONS)}")
        uniform = space.uniform(precision, parse_knobs([item for item in knob_text.split(",") if item]))
        base = str(uniform.knob("base_precision", "fp32"))
        chosen = re.compile(pattern) if pattern else None
        precisions = {}
        for layer, options in zip(space.layers, space.choices, strict=True):
            wanted = precision if chosen is None or chosen.search(layer.name) else base
            precisions[layer.name] = wanted if wanted in options else "fp32"
        plan = space.plan(precisions, uniform.knob_map)
    problems = space.violations(plan)
    if problems:
        raise ValueError("; ".join(problems))
    return plan


def first_line(text: str | None, limit: int = 160) -> str:
    """The last non-empty line of an error (a traceback's message), cut and escaped for a table cell."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return (line if len(line) <= limit else line[: limit - 3] + "...").replace("|", "\\|")


def failure_row(name: str, error: str, status: str = "error") -> dict[str, Any]:
    """A row for what gave no result: a config that did not start, a spec that does not resolve."""
    return {"row": name, "status": status, "error": error}


def result_row(name: str, result: Any, accuracy_budget: float) -> dict[str, Any]:
    """A row of one ``TrialResult``: both timings, the drop and whether it is within the budget."""
    from autotune.search.reward import meets_budget

    row = failure_row(name, result.error, result.status)
    timings = ("latency_ms", "speedup", "back_to_back_ms", "reference_latency_ms", "reference_back_to_back_ms")
    row.update({key: getattr(result, key) for key in (*timings, "accuracy_drop")})
    # Under 0.05 s nothing was built: the FP32 reference's build reused, or a summary from before builds were kept
    row["build_s"] = result.build_s if result.build_s >= 0.05 else None
    return {**row, "within_budget": meets_budget(result, accuracy_budget) if result.ok else None}


def fastest_within(results: dict[str, Any], accuracy_budget: float) -> str | None:
    """The name of the fastest result one launch at a time (``speedup``) within the budget, or None."""
    from autotune.search.reward import meets_budget

    within = [(result.speedup, name) for name, result in results.items() if meets_budget(result, accuracy_budget)]
    return max(within, default=(None, None))[1]


def winner_over_one_liners(winner: Any, one_liners: dict[str, Any], accuracy_budget: float) -> dict[str, Any]:
    """Per timing, ``ratio`` of the winner over the fastest one-liner within the budget in that timing.

    The fastest one-liner is the one the winner's ratio is lowest against; back to back it may be another than
    one launch at a time.

    Returns:
        Timing -> ``{"ratio": float | None, "one_liner": name | None}``.
    """
    from autotune.run.trial import TIMINGS, ratio
    from autotune.search.reward import meets_budget

    within = {name: result for name, result in one_liners.items() if meets_budget(result, accuracy_budget)}
    figures = {}
    for timing in TIMINGS:
        ratios = [] if winner is None else [(ratio(result, winner, timing), name) for name, result in within.items()]
        value, name = min(((v, n) for v, n in ratios if v is not None), default=(None, None))
        figures[timing] = {"ratio": value, "one_liner": name}
    return figures


def tune_table(summary: dict[str, Any]) -> dict[str, Any]:
    """The rows (FP32, each one-liner, the winner) and figures of a tuning run's ``summary.json``."""
    from autotune.plan import Plan
    from autotune.run.trial import TrialResult

    fields = {field.name for field in dataclasses.fields(TrialResult)} - {"plan", "from_store"}

    def summary_result(entry: dict[str, Any], plan: Plan) -> TrialResult:  # the result fields a summary keeps
        return TrialResult(plan=plan, **{key: value for key, value in entry.items() if key in fields})

    budget = summary["accuracy_budget"]
    winner = summary_result(summary["winner"], Plan.make({}))
    references = summary.get("references") or {}
    one_liners = {name: summary_result(entry, Plan.reference_plan([], name)) for name, entry in references.items()}
    fp32 = summary.get("fp32_reference")
    rows = [result_row("FP32", summary_result(fp32, Plan.make({})), budget)] if fp32 else []
    rows += [result_row(name, result, budget) for name, result in one_liners.items()]
    rows.append(result_row("winner", winner, budget))
    figures = {key: summary.get(key) for key in ("builds", "self_check", "wall_s", "setup_s", "setup_stages_s")}
    ratios = winner_over_one_liners(winner, one_liners, budget)
    return {"rows": rows, "ratios": ratios, "accuracy_budget": budget, "winner_plan": summary.get("plan"), **figures}


def build_times(store_path: Path) -> dict[str, Any]:
    """The build seconds of a run's own trials (not imported ones): fewest, most, the compile share; its set-up."""
    from autotune.run.meta import RunMeta
    from autotune.run.store import TrialStore

    with TrialStore(store_path) as store:
        imported, meta = store.imported(), RunMeta.read(store)  # a run cut before its summary has its set-up here
        trials = [trial for trial in store.trials() if trial.plan_hash not in imported and trial.build_s > 0]
    staged = [trial for trial in trials if trial.build_stages_s]  # where the backend says where the time went
    compile_s = sum(trial.build_stages_s.get(stage, 0.0) for trial in staged for stage in COMPILE_STAGES)
    return {
        "trials": len(trials),
        "build_min_s": min((trial.build_s for trial in trials), default=None),
        "build_max_s": max((trial.build_s for trial in trials), default=None),
        "build_median_s": statistics.median(trial.build_s for trial in trials) if trials else None,
        "compile_share": compile_s / sum(trial.build_s for trial in staged) if staged else None,
        **{"setup_s": meta.setup_s, "setup_stages_s": meta.setup_stages_s},
    }


def write(results: dict[str, Any], out: Path) -> None:
    """Writes ``gpu.json`` and ``gpu.md``, each replaced whole so a kill never leaves half a file."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("gpu.json", json.dumps(results, indent=2, default=str)), ("gpu.md", markdown(results))):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)


def _cell(value: Any, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, fmt) + suffix


def run_markdown(run: dict[str, Any]) -> list[str]:
    """One run's table (``row | one launch ms | back to back ms | drop | within budget``), then its figures."""
    lines = [f"### {run['config']} ({run['kind']})", ""]
    lines += [f"Winner: {run['winner_plan']}", ""] if run.get("winner_plan") else []
    lines += ["| row | one launch ms | back to back ms | drop | within budget | build s |", "|---|---|---|---|---|---|"]
    for row in run["rows"]:
        if row["status"] != "ok":  # one line: the error's message
            lines.append(f"| {row['row']} | {row['status']}: {first_line(row.get('error'))} | - | - | - | - |")
            continue
        within = "-" if row.get("within_budget") is None else ("yes" if row["within_budget"] else "NO")
        timings = f"{_cell(row.get('latency_ms'), '.4f')} | {_cell(row.get('back_to_back_ms'), '.4f')}"
        drop = _cell(row.get("accuracy_drop"), ".3g")
        lines.append(f"| {row['row']} | {timings} | {drop} | {within} | {_cell(row.get('build_s'), '.1f')} |")
    lines.append("")
    if run.get("ratios"):
        parts = [f"{t} {_cell(f['ratio'], '.2f', 'x')} ({f['one_liner'] or 'none'})" for t, f in run["ratios"].items()]
        budget = _cell(run.get("accuracy_budget"), "g")
        lines.append(f"Winner over the fastest one-liner within the budget ({budget}): {', '.join(parts)}.")
    times = run.get("build_times") or {}
    setup = run if run.get("setup_s") is not None else times
    if setup.get("setup_s") is not None:
        stages = ", ".join(f"{stage} {s:.1f} s" for stage, s in (setup.get("setup_stages_s") or {}).items())
        lines.append(f"Set-up: {setup['setup_s']:.1f} s" + (f" ({stages})." if stages else "."))
    builds = run["builds"] if run.get("builds") is not None else times.get("trials")
    if builds and times.get("build_min_s") is not None:
        spread = f"{times['build_min_s']:.1f}-{_cell(times.get('build_max_s'), '.1f')} s"
        if times.get("build_median_s") is not None:
            spread += f" (median {times['build_median_s']:.1f} s)"
        share = _cell(None if times.get("compile_share") is None else 100 * times["compile_share"], ".0f", " %")
        lines.append(f"Builds: {builds}, {spread} each; compile {share} of the build time.")
    elif builds:
        lines.append(f"Builds: {builds}.")
    checks = [
        f"{name} {check['ratio']:.3f} ({'within' if check.get('within_band') else 'OUTSIDE'} the band)"
        for name, check in (run.get("self_check") or {}).items()
        if isinstance(check, dict) and check.get("ratio") is not None
    ]
    lines += [f"Timing self-check (FP32 against itself): {', '.join(checks)}."] if checks else []
    if run.get("exit_code") is not None:
        stopped = ", stopped by --time-limit (SIGINT)" if run.get("interrupted") else ""
        wall = f" (the run's wall_s {run['wall_s']:.0f} s)" if run.get("wall_s") is not None else ""
        lines.append(f"Run: exit {run['exit_code']}{stopped}, {run['child_s']:.0f} s in all{wall}.")
    return [*lines, ""]


def gemm_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The GEMM table: median ms per graph replay, and BF16 ms over each kernel's (above 1: faster than BF16)."""
    others = GEMM_KERNELS[1:]
    lines = [
        "### GEMMs: median ms per replay of a CUDA graph (BF16 ms / kernel ms; above 1: faster than BF16)",
        "",
        "| M | K | N | BF16 ms | " + " | ".join(others) + " | error |",
        "|---|---|---|---|" + "---|" * len(others) + "---|",
    ]
    for row in rows:
        ms, over = row["ms"], row["over_bf16"]
        cells = " | ".join(f"{ms[k]:.4f} ({over[k]:.2f}x)" if k in over else _cell(ms.get(k), ".4f") for k in others)
        error = "; ".join(f"{kernel}: {first_line(text, 80)}" for kernel, text in row["errors"].items())
        lines.append(f"| {row['m']} | {row['k']} | {row['n']} | {_cell(ms.get('bf16'), '.4f')} | {cells} | {error} |")
    return [*lines, ""]


def markdown(results: dict[str, Any]) -> str:
    """The results as markdown: what was measured where, then a table per run, then the GEMMs."""
    env, command = results.get("environment", {}), results.get("command", "")
    measured = (
        f"Measured {results.get('date', '?')} on {env.get('device', 'no CUDA device')} (driver "
        f"{env.get('driver') or '?'}), torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}, torchao "
        f"{env.get('torchao', '?')}, transformers {env.get('transformers', '?')}."
    )
    if command.startswith("python bench/gpu.py table"):  # nothing is measured here: each summary names its machine
        measured = f"Runs already made, as their summary.json files hold them (rendered {results.get('date', '?')})."
    lines = [measured, "", f"Command: `{command}`", ""]
    for run in results.get("runs", []):
        lines += run_markdown(run)
    lines += gemm_markdown(results["gemm"]) if results.get("gemm") else []
    return "\n".join(lines)


def run_child(command: list[str], log_path: Path, limit: float) -> tuple[int, bool]:
    """Runs a command into ``log_path``; its exit status, and whether ``limit`` seconds interrupted it.

    Past the limit its process group gets SIGINT, as from ``timeout -s INT``: the run's trial processes stop with
    it as on Ctrl-C, and the run keeps its trials (confirms and exports what it has, where it does that).
    """
    with log_path.open("w") as log_file:
        child = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return child.wait(timeout=None if math.isinf(limit) else limit), False
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGINT)
            return child.wait(), True
        except BaseException:  # this script is stopped: its child, in a session of its own, is stopped with it
            os.killpg(child.pid, signal.SIGINT)
            raise


def tune_command(config_path: str, overrides: Sequence[str]) -> list[str]:
    """The ``autotune tune`` command line of one config (``overrides`` include ``runs_dir``)."""
    sets = [arg for override in overrides for arg in ("--set", override)]
    return [sys.executable, "-m", "autotune", "tune", config_path, "--no-progress", *sets]


def run_tune(record: dict[str, Any], args: argparse.Namespace, results: dict[str, Any]) -> None:
    """One tuning run in a child process; then its rows from ``summary.json``, its build times from the store."""
    from autotune.config.schema import load_config
    from autotune.run.directory import RunDir

    overrides = [f"runs_dir={(args.out / 'runs').resolve()}", *record["overrides"]]
    config = load_config(record["path"], overrides)
    run_dir, log_path = RunDir(config.run_dir), args.out / f"{config.name}.log"
    record.update(config=config.name, log=str(log_path))
    log(f"{config.name}: tuning (time left {_cell(time_left(args), '.0f', ' s')}), log in {log_path}")
    # A summary the child did not write is an earlier run's (tune refuses a directory that holds a run).
    earlier = run_dir.summary.stat().st_mtime_ns if run_dir.summary.exists() else None
    launched = time.perf_counter()
    code, interrupted = run_child(tune_command(record["path"], overrides), log_path, time_left(args))
    record.update(exit_code=code, interrupted=interrupted, child_s=time.perf_counter() - launched)
    if run_dir.store.exists():
        record["build_times"] = build_times(run_dir.store)
    if run_dir.summary.exists() and run_dir.summary.stat().st_mtime_ns != earlier:
        record.update(tune_table(json.loads(run_dir.summary.read_text())))
        return
    tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["an empty log"]
    error = f"{'stopped by --time-limit; ' if interrupted else ''}no summary.json (exit {code}): {tail[0]}"
    record["rows"].append(failure_row("tune", error, "interrupted" if interrupted else "error"))


def made_run(path: Path) -> dict[str, Any]:
    """``tune``'s record of a run already made: a run directory, or a ``summary.json`` kept from one."""
    from autotune.run.directory import RunDir

    record: dict[str, Any] = dict(kind="tune", config=path.stem if path.is_file() else path.name, path=str(path))
    record["rows"] = []
    try:
        run_dir = None if path.is_file() else RunDir(path)
        summary = json.loads((path if run_dir is None else run_dir.summary).read_text())
        if run_dir is not None and run_dir.store.exists():
            record["build_times"] = build_times(run_dir.store)
        record.update(tune_table(summary))
    except Exception as error:  # noqa: BLE001 - a file that is not a run's summary is a row, not a crash
        record["rows"].append(failure_row(record["config"], f"{type(error).__name__}: {error}"))
    return record


def run_plans(record: dict[str, Any], args: argparse.Namespace, results: dict[str, Any]) -> None:
    """The plan specs and the one-liners of one config, measured side by side in this process."""
    from autotune.backends.base import DEVICE_OWNER_ENV
    from autotune.config.schema import load_config
    from autotune.harness.runner import CONFIRMATION_SPLIT, TrialRunner, confirmation_protocol
    from autotune.plan import Plan

    config = load_config(record["path"], [f"runs_dir={args.out / 'runs'}", *record["overrides"]])
    budget = config.accuracy_budget
    record.update(config=config.name, accuracy_budget=budget)
    os.environ[DEVICE_OWNER_ENV] = "1"  # this process builds and times: the backend may start CUDA here
    log(f"{config.name}: preparing the runner (model, calibration, FP32 reference)")
    started = time.perf_counter()
    runner = TrialRunner(config)
    record["setup_s"] = time.perf_counter() - started
    names = list(runner.backend.references()) if args.references is None else args.references
    entries: list[tuple[str, Any]] = [(name, Plan.reference_plan(runner.space.layer_names, name)) for name in names]
    for spec in args.plans:
        try:
            entries.append((spec, resolve(spec, runner.space)))
        except Exception as error:  # noqa: BLE001 - a spec that does not resolve is a row with its error
            entries.append((spec, f"plan {spec}: {type(error).__name__}: {error}"))
    plans = {name: plan for name, plan in entries if not isinstance(plan, str)}
    log(f"{config.name}: ready after {record['setup_s']:.1f} s; {len(plans)} plans side by side")
    write(results, args.out)
    measured = runner.run_side_by_side(
        list(plans.values()), CONFIRMATION_SPLIT, confirmation_protocol(config.measure, config.confirm)
    )
    by_hash = {result.plan_hash: result for result in measured}
    found = {name: by_hash[plan.hash] for name, plan in plans.items()}
    timed = next((result for result in found.values() if result.reference_latency_ms), None)
    if timed is not None:  # every plan was timed in FP32's rounds: one FP32 row, of the reference's timings
        timings = {"latency_ms": timed.reference_latency_ms, "back_to_back_ms": timed.reference_back_to_back_ms}
        fp32 = dataclasses.replace(timed, speedup=1.0, accuracy_drop=0.0, **timings)
        record["rows"].append(result_row("FP32", fp32, budget))
    for name, plan in entries:  # a spec that did not resolve is a row of its error
        row = failure_row(name, plan) if isinstance(plan, str) else result_row(name, found[name], budget)
        record["rows"].append(row)
    one_liners = {name: found[name] for name in names}
    winner = fastest_within({name: result for name, result in found.items() if name not in one_liners}, budget)
    record["winner_plan"] = None if winner is None else f"{winner}: {found[winner].plan.describe()}"
    record["ratios"] = winner_over_one_liners(found.get(winner), one_liners, budget)


def graph_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median ms of one replay of ``fn`` captured in a CUDA graph (no launch overhead, no compile)."""
    import numpy as np
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def gemm_kernels(m: int, k: int, n: int) -> dict[str, Callable[[], Any]]:
    """The kernels of one shape, each a closure over its own operands on the GPU."""
    import torch

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    x8, w8 = (x / 8).to(fp8), (w * 8).to(fp8)
    row_a, col_b = torch.full((m, 1), 0.125, device="cuda"), torch.full((1, n), 0.125, device="cuda")
    xi = torch.randint(-128, 127, (m, k), device="cuda", dtype=torch.int8)
    wi = torch.randint(-128, 127, (n, k), device="cuda", dtype=torch.int8)
    one, act_scale = torch.ones((), device="cuda"), torch.tensor(0.05, device="cuda")

    def fp8_rowwise_quant() -> Any:
        q = torch.clamp(x / act_scale, -448.0, 448.0).to(fp8)
        return torch._scaled_mm(q, w8.t(), scale_a=row_a, scale_b=col_b, out_dtype=bf16)

    def int8_quant() -> Any:
        q = torch.clamp(torch.round(x / act_scale), -128, 127).to(torch.int8)
        return torch._int_mm(q, wi.t()).to(bf16) * act_scale

    return {
        "bf16": lambda: torch.mm(x, w.t()),
        "fp8_rowwise_gemm": lambda: torch._scaled_mm(x8, w8.t(), scale_a=row_a, scale_b=col_b, out_dtype=bf16),
        "fp8_rowwise_quant": fp8_rowwise_quant,
        "fp8_tensorwise_gemm": lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=bf16),
        "int8_gemm": lambda: torch._int_mm(xi, wi.t()),
        "int8_quant": int8_quant,
    }


def run_gemm(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Every shape, every kernel; a row per shape, written as it completes."""
    for m, k, n in [(m, k, n) for m in GEMM_M for k, n in GEMM_KN]:
        row: dict[str, Any] = {"m": m, "k": k, "n": n, "ms": {}, "over_bf16": {}, "errors": {}}
        results["gemm"].append(row)
        kernels: dict[str, Callable[[], Any]] = {}
        if time_left(args) <= 0:
            row["errors"]["*"] = "not started: --time-limit reached"
        else:
            try:
                kernels = gemm_kernels(m, k, n)
            except Exception as error:  # noqa: BLE001 - a shape that cannot be set up is a row with its error
                row["errors"]["*"] = f"{type(error).__name__}: {error}"
        for name, fn in kernels.items():
            try:
                row["ms"][name] = graph_ms(fn, args.repeats)
            except Exception as error:  # noqa: BLE001
                row["errors"][name] = f"{type(error).__name__}: {error}"
        base = row["ms"].get("bf16")
        row["over_bf16"] = {name: base / ms for name, ms in row["ms"].items() if base and name != "bf16"}
        if kernels:
            import torch

            del kernels
            torch.cuda.empty_cache()  # the next shape's operands get the memory
        write(results, args.out)
        log(f"gemm {m}x{k}x{n}: bf16 {_cell(base, '.4f')} ms; over bf16 {row['over_bf16'] or row['errors']}")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line; ``runs`` holds (config, overrides) of each config, for ``tune`` one per ``--`` group.

    Raises:
        SystemExit: Arguments that do not parse, a group after ``--`` included (argparse's one-line error).
    """
    groups: list[list[str]] = [[]]  # split by hand: argparse takes whatever follows "--" as positionals
    for arg in argv:
        if arg == "--" and argv[:1] == ["tune"]:
            groups.append([])
        else:
            groups[-1].append(arg)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", type=Path, required=True, help="folder for gpu.json, gpu.md, logs and runs")
    common.add_argument("--time-limit", type=float, help="seconds after which no new work starts")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    tune = commands.add_parser("tune", parents=[common], help="tuning runs against the one-liners")
    tune.add_argument("config", help="config YAML; more after --: -- CONFIG [--set KEY=VALUE ...]")
    plans = commands.add_parser("plans", parents=[common], help="plans and one-liners side by side")
    plans.add_argument("config", help="config YAML")
    plans.add_argument("--plans", nargs="+", required=True, help="PRECISION[@REGEX][:knob=value,...] or a plan .json")
    plans.add_argument("--references", nargs="*", help="one-liners to measure (default: all the backend offers)")
    for command in (tune, plans):
        command.add_argument("--set", action="append", default=[], help="config override (KEY=VALUE)")
    gemm = commands.add_parser("gemm", parents=[common], help="the GEMM kernels against BF16")
    gemm.add_argument("--repeats", type=int, default=50, help="timed graph replays per kernel")
    table = commands.add_parser("table", parents=[common], help="tune's table of runs already made")
    table.add_argument("summaries", nargs="+", type=Path, help="a run directory, or a summary.json")
    args = parser.parse_args(groups[0])
    later = argparse.ArgumentParser(prog="gpu.py tune ... --", description="one more config of tune")
    later.add_argument("config")
    later.add_argument("--set", action="append", default=[])
    args.runs = [] if args.command in ("gemm", "table") else [(args.config, args.set)]
    args.runs += [(group.config, group.set) for group in map(later.parse_args, groups[1:])]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one subcommand; writes gpu.json and gpu.md into --out after every row."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.started = time.perf_counter()
    use_repository_paths()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python bench/gpu.py " + " ".join(shlex.quote(arg) for arg in argv),
        "environment": environment(),
        "runs": [],
        "gemm": [],
    }
    write(results, args.out)
    log(f"{results['environment'].get('device', 'no CUDA device')}: {args.command}")
    if args.command == "gemm":
        run_gemm(args, results)
    if args.command == "table":
        results["runs"] += [made_run(path) for path in args.summaries]
    for config_path, overrides in args.runs:
        record = dict(kind=args.command, config=Path(config_path).stem, path=config_path, overrides=overrides, rows=[])
        results["runs"].append(record)
        if time_left(args) <= 0:
            record["rows"].append(failure_row(record["config"], "not started: --time-limit reached", "skipped"))
        else:
            try:
                (run_tune if args.command == "tune" else run_plans)(record, args, results)
            except Exception as error:  # noqa: BLE001 - a config that fails is a row; the next one still runs
                record["rows"].append(failure_row(record["config"], f"{error!r}\n{traceback.format_exc()}"))
        write(results, args.out)
        log(f"{record['config']}: " + ", ".join(f"{row['row']} {row['status']}" for row in record["rows"]))
    results["wall_s"] = time.perf_counter() - args.started
    write(results, args.out)
    print(markdown(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
