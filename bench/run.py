"""Strategies x seeds on one config with the same build budget: a results table and a best-so-far plot.

Usage:
    python bench/run.py configs/minilm-cpu.yaml --strategies ppo random greedy optuna fp32 int8
        --seeds 0 1 2 --budget 150 --out bench/results/minilm-cpu

Runs share the calibration cache (``cache_dir``) but not the trial store: each strategy pays for its own builds.
Every trial measures its FP32 reference interleaved in the same process, so rewards compare across runs.

On a machine with many cores, ``--jobs N`` runs N strategy-seed runs at once, each pinned to its own
``--cores-per-job`` physical cores (set the config's ``backend.intra_op_threads`` to match): the first run goes
alone, so the model export and the calibration cache are made once. Interrupted (Ctrl-C, SIGTERM), every run
keeps its trials; the same command resumes them all.

``--reevaluate`` measures nothing new in the search: it re-measures every finished run's exported winner and the
backend's one-liners on this machine, all side by side (built in one process, timed against FP32 in the same
rounds), on the held-out split with the confirmation protocol. Winners confirmed on a busy host (``--jobs``), or
in runs hours apart, are thus compared again under one set of conditions; ``--set confirm.rounds=N`` times more
rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from autotune import api
from autotune.config.schema import TuneConfig, load_config
from autotune.measure.confidence import compare_rounds
from autotune.plan import Plan
from autotune.run.store import TrialStore
from autotune.search.reward import meets_budget, reward
from autotune.tune import tune

FIXED = ("fp32", "int8", "fp16")
DETERMINISTIC = ("greedy",)


def best_so_far(rewards: list[float]) -> list[float]:
    """Running maximum."""
    return list(np.maximum.accumulate(rewards)) if rewards else []


def run_config(config_path: str, strategy: str, seed: int, budget: int, out: Path, overrides: list[str]) -> TuneConfig:
    """The config of one strategy-seed run of the benchmark: its own run directory under ``out/runs``."""
    return load_config(
        config_path,
        [f"budget.builds={budget}", f"seed={seed}", f"name={strategy}-s{seed}", f"runs_dir={out / 'runs'}", *overrides],
    )


def run_one(
    config_path: str, strategy: str, seed: int, budget: int, out: Path, overrides: list[str], report: bool = False
) -> dict | None:
    """One strategy and seed; returns its curve and headline numbers.

    With ``report``, nothing runs: an unfinished run is reported as far as it got (no confirmed winner yet), and a
    run that never started gives None.
    """
    config = run_config(config_path, strategy, seed, budget, out, overrides)
    run_dir = config.run_dir
    started = time.time()
    if report and not (run_dir / "trials.sqlite").exists():
        return None
    if not report and not (run_dir / "summary.json").exists():
        if (run_dir / "trials.sqlite").exists():
            tune(resume_dir=run_dir, progress=False)
        else:
            tune(config, strategy=strategy, progress=False)
    finished = (run_dir / "summary.json").exists()
    summary = json.loads((run_dir / "summary.json").read_text()) if finished else {"winner": None}
    plan_file = run_dir / "best" / "plan.json"
    with TrialStore(run_dir / "trials.sqlite") as store:
        trials = list(store.trials())
        wall = store.get_meta("wall_s")  # written when the run ends or is interrupted
        wall_s = float(wall) if wall is not None else None if report else time.time() - started
    rewards = [reward(t, config.reward, config.accuracy_budget) for t in trials]
    within = [t for t in trials if meets_budget(t, config.accuracy_budget)]
    best_within = max(within, key=lambda t: t.speedup) if within else None
    speedups = [t.speedup if meets_budget(t, config.search_budget) and t.speedup else 1.0 for t in trials]
    return {
        "strategy": strategy,
        "seed": seed,
        "builds": len(trials),
        "curve": best_so_far(rewards),
        # Best search speedup within the search budget after each build: what greedy's confirmed result is timed on.
        "speedup_curve": best_so_far(speedups),
        "best_reward": max(rewards) if rewards else None,
        "search_best_within_budget": {
            "speedup": best_within.speedup if best_within else None,
            "accuracy_drop": best_within.accuracy_drop if best_within else None,
        },
        "confirmed_winner": summary["winner"],
        # The exported plan itself: winners can be measured side by side again after the run directories are gone.
        "winner_plan": json.loads(plan_file.read_text()) if finished and plan_file.exists() else None,
        # The backend's one-liners, measured in this run like its finalists (held-out data, same protocol).
        "references": summary.get("references") or {},
        "finished": finished,
        "wall_s": wall_s,
        # Survives interruptions, unlike wall time: what the run paid to build and measure its trials.
        "trial_s": sum(t.total_s or 0.0 for t in trials),
        "cpus": sorted(os.sched_getaffinity(0)),
    }


def builds_to_reach(curve: list[float], target: float) -> int | None:
    """First build (1-based) whose best-so-far reaches ``target``."""
    for index, value in enumerate(curve):
        if value >= target:
            return index + 1
    return None


def _cell(values: list[float | None], fmt: str) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "-"
    if len(present) == 1:
        return format(present[0], fmt)
    return f"{format(float(np.median(present)), fmt)} [{format(min(present), fmt)}, {format(max(present), fmt)}]"


def table(results: list[dict], budget: int) -> tuple[str, float]:
    """The markdown results table (median [min, max] over seeds) and the target reward."""
    best_any = max(r["best_reward"] for r in results if r["best_reward"] is not None)
    target = best_any - 0.02 * abs(best_any)
    lines = [
        "| strategy | seeds | best reward | confirmed speedup | confirmed drop | search: best speedup in budget "
        "| builds to 98% of best | builds | trial s | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for strategy in dict.fromkeys(r["strategy"] for r in results):
        rows = [r for r in results if r["strategy"] == strategy]
        reach = [builds_to_reach(r["curve"], target) for r in rows]
        reach_text = _cell([float(x) for x in reach if x is not None], ".0f")
        if any(x is None for x in reach):
            reach_text += f" ({sum(x is None for x in reach)}/{len(rows)} never)"
        lines.append(
            f"| {strategy} | {len(rows)} | {_cell([r['best_reward'] for r in rows], '.3f')} "
            f"| {_cell([(r['confirmed_winner'] or {}).get('speedup') for r in rows], '.2f')} "
            f"| {_cell([(r['confirmed_winner'] or {}).get('accuracy_drop') for r in rows], '.4f')} "
            f"| {_cell([r['search_best_within_budget']['speedup'] for r in rows], '.2f')} "
            f"| {reach_text} | {_cell([float(r['builds']) for r in rows], '.0f')} "
            f"| {_cell([r.get('trial_s') for r in rows], '.0f')} | {_cell([r['wall_s'] for r in rows], '.0f')} |"
        )
    lines += reference_rows(results)
    lines += greedy_rows(results)
    return "\n".join(lines), target


def greedy_rows(results: list[dict], fraction: float = 0.98) -> list[str]:
    """Per strategy, the builds until its best search plan within the budget reaches a fraction of greedy's result.

    Greedy's result is its confirmed held-out speedup, the median over its seeds; no rows without one.
    """
    greedy = [(r["confirmed_winner"] or {}).get("speedup") for r in results if r["strategy"] == "greedy"]
    greedy = [value for value in greedy if value]
    if not greedy:
        return []
    target = fraction * float(np.median(greedy))
    lines = ["", f"| strategy | builds to {fraction:.0%} of greedy's confirmed speedup ({target:.2f}x) |", "|---|---|"]
    for strategy in dict.fromkeys(r["strategy"] for r in results):
        reach = [builds_to_reach(r.get("speedup_curve", []), target) for r in results if r["strategy"] == strategy]
        text = _cell([float(x) for x in reach if x is not None], ".0f")
        if any(x is None for x in reach):
            text += f" ({sum(x is None for x in reach)}/{len(reach)} never)"
        lines.append(f"| {strategy} | {text} |")
    return lines


def reference_rows(results: list[dict]) -> list[str]:
    """One row per one-liner of the backend: its confirmed speedup and drop, as every run measured it.

    Each run measures the one-liners beside its own finalists (held-out data, confirmation protocol), so the
    cells are the median [min, max] over the runs, as the strategies' are over seeds; search columns are empty.
    """
    measured: dict[str, list[dict]] = {}
    for result in results:
        for name, row in (result.get("references") or {}).items():
            measured.setdefault(name, []).append(row)
    lines = []
    for name, rows in measured.items():
        ok = [row for row in rows if row.get("status", "ok") == "ok" and row.get("speedup") is not None]
        if not ok:
            error = str(rows[-1].get("error") or "failed").strip().splitlines()[-1].replace("|", "/")
            lines.append(f"| {name} (one-liner) | {len(rows)} runs | - | failed: {error} | - | - | - | - | - | - |")
            continue
        lines.append(
            f"| {name} (one-liner) | {len(rows)} runs | - | {_cell([row['speedup'] for row in ok], '.2f')} "
            f"| {_cell([row['accuracy_drop'] for row in ok], '.4f')} | - | - | - | - | - |"
        )
    return lines


def plot(results: list[dict], budget: int, path: Path, title: str) -> None:
    """Best-so-far reward against builds: median over seeds, min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5), dpi=120)
    lowest_shown = -1.5  # all-INT8 over the budget can score far below; keep the searches readable
    for strategy in dict.fromkeys(r["strategy"] for r in results):
        curves = [r["curve"] for r in results if r["strategy"] == strategy and r["curve"]]
        if not curves:
            continue
        if strategy in FIXED:
            value = curves[0][-1]
            label = f"{strategy} (1 build, reward {value:.2f})"
            style = {"fp32": ":", "int8": "--"}.get(strategy, "-.")
            axes.axhline(max(value, lowest_shown), color="black", linestyle=style, linewidth=1, label=label)
            continue
        length = max(len(c) for c in curves)
        padded = np.array([c + [c[-1]] * (length - len(c)) for c in curves])
        x = np.arange(1, length + 1)
        (line,) = axes.plot(x, np.median(padded, axis=0), label=f"{strategy} (median of {len(curves)})")
        if len(curves) > 1:
            axes.fill_between(x, padded.min(axis=0), padded.max(axis=0), color=line.get_color(), alpha=0.15)
    axes.set_ylim(bottom=lowest_shown - 0.1)
    axes.set_xlabel("builds")
    axes.set_ylabel("best-so-far reward  (log speedup - penalty)")
    axes.set_title(title)
    axes.set_xlim(1, budget)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return ", " + line.split(":", 1)[1].strip()
    return ""


def _here() -> str:
    """Today and this machine, for a results header (the closing parenthesis is the caller's)."""
    return (
        f"{time.strftime('%Y-%m-%d')} on {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs"
        f"{_cpu_model()}, Python {platform.python_version()}"
    )


def _siblings(cpu: int) -> str:
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    return path.read_text().strip() if path.exists() else str(cpu)


def by_core(cpus: list[int]) -> list[int]:
    """``cpus`` reordered so that the hyperthreads of one physical core are next to each other."""
    groups: dict[str, list[int]] = {}
    for cpu in cpus:
        groups.setdefault(_siblings(cpu), []).append(cpu)
    return [cpu for group in groups.values() for cpu in group]


def physical_cores() -> list[int]:
    """One logical CPU per physical core this process may use (hyperthread siblings left out), in order."""
    allowed = sorted(os.sched_getaffinity(0))
    chosen: list[int] = []
    seen: set[str] = set()
    for cpu in allowed:
        key = _siblings(cpu)
        if key not in seen:
            seen.add(key)
            chosen.append(cpu)
    return chosen


def _part_path(out: Path, strategy: str, seed: int) -> Path:
    return out / "parts" / f"{strategy}-s{seed}.json"


def run_parallel(args: argparse.Namespace, runs: list[tuple[str, int]]) -> list[dict]:
    """Runs the first run here, then the rest as child processes, ``args.jobs`` at a time, each on its own cores."""
    cores = physical_cores()
    if len(cores) < args.jobs * args.cores_per_job:
        # not enough physical cores: hand out hyperthreads, siblings together, so runs still share no core
        cores = by_core(sorted(os.sched_getaffinity(0)))
    slots = min(args.jobs, len(cores) // args.cores_per_job)
    if slots < 1:
        raise SystemExit(f"--cores-per-job {args.cores_per_job} exceeds the {len(cores)} CPUs here")
    core_sets = [cores[i * args.cores_per_job : (i + 1) * args.cores_per_job] for i in range(slots)]
    print(f"[bench] {slots} runs at a time on cores {core_sets}", flush=True)
    results = {runs[0]: run_one(args.config, *runs[0], args.budget, args.out, args.set)}
    pending = list(runs[1:])
    running: dict[subprocess.Popen, tuple[tuple[str, int], list[int]]] = {}
    free = list(core_sets)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        while pending or running:
            while pending and free:
                strategy, seed = pending.pop(0)
                cpus = free.pop(0)
                command = [sys.executable, __file__, args.config, "--strategies", strategy, "--seeds", str(seed)]
                command += ["--budget", str(args.budget), "--out", str(args.out), "--part"]
                command += [item for override in args.set for item in ("--set", override)]
                environment = dict(os.environ, OMP_NUM_THREADS=str(len(cpus)))
                log = open(args.out / "parts" / f"{strategy}-s{seed}.log", "a")  # noqa: SIM115 (closed with the run)
                child = subprocess.Popen(
                    command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=environment,
                    preexec_fn=lambda cpus=cpus: os.sched_setaffinity(0, cpus),
                    start_new_session=True,  # a Ctrl-C or timeout reaches it once, forwarded below
                )
                log.close()
                running[child] = ((strategy, seed), cpus)
                print(f"[bench] {strategy} seed {seed} on cores {cpus}", flush=True)
            time.sleep(2)
            for child in [c for c in running if c.poll() is not None]:
                (strategy, seed), cpus = running.pop(child)
                free.append(cpus)
                part = _part_path(args.out, strategy, seed)
                if child.returncode != 0 or not part.exists():
                    raise SystemExit(
                        f"{strategy} seed {seed} failed (exit {child.returncode}); see {part.with_suffix('.log')}"
                    )
                results[(strategy, seed)] = json.loads(part.read_text())
                print(f"[bench] {strategy} seed {seed} done", flush=True)
    except KeyboardInterrupt:
        # Each run saves its trials and agent on SIGINT, as a run does on Ctrl-C; the same command resumes them.
        for child in running:
            child.send_signal(signal.SIGINT)
        for child in running:
            child.wait()
        raise
    return [results[run] for run in runs]


def reevaluate(args: argparse.Namespace, runs: list[tuple[str, int]]) -> list[dict]:
    """Re-measures every finished run's exported winner here, all side by side (see the module docstring).

    The winners and the backend's one-liners are built in one process and timed against FP32 in the same rounds
    (held-out split, confirmation protocol), so machine drift cannot decide which winner comes out ahead. A fixed
    reference (``int8``, ``fp16``) exports FP32 whenever its uniform plan misses the budget; its row measures the
    uniform plan itself.
    """
    names, specs = [], []
    config = None
    for strategy, seed in runs:
        run = run_config(args.config, strategy, seed, args.budget, args.out, args.set)
        plan_file = run.run_dir / "best" / "plan.json"
        if not (run.run_dir / "summary.json").exists() or not plan_file.exists():
            continue
        config = config or run.model_copy(
            update={"measure": run.measure.model_copy(update=run.confirm.model_dump(exclude={"top_k"}))}
        )
        names.append((strategy, seed))
        specs.append(strategy if strategy in FIXED else str(plan_file))
    if config is None:
        return []
    split = "holdout" if config.data.holdout is not None else "evaluation"
    one_liners = list(api.references(config))
    names += [(name, 0) for name in one_liners]
    print(f"[bench] re-evaluating {len(specs)} winners and {len(one_liners)} one-liners side by side on {split}")
    measured = api.evaluate_side_by_side(config, specs + one_liners, split=split)
    return [
        _reevaluated(strategy, seed, result, config.accuracy_budget, split)
        for (strategy, seed), result in zip(names, measured, strict=True)
    ]


def _reevaluated(strategy: str, seed: int, measured: dict, accuracy_budget: float, split: str) -> dict:
    """One row of ``reevaluated.json`` from ``api.evaluate``'s result."""
    plan = Plan.from_dict(measured["plan"])
    return {
        "strategy": strategy,
        "seed": seed,
        "plan": measured["plan_summary"],
        "quantized_layers": sum(p != "fp32" for _, p in plan.precisions),
        "layers": len(plan.precisions),
        "knobs": plan.knob_map,
        "speedup": measured["speedup"],
        "round_speedups": measured.get("round_speedups") or [],
        "accuracy_drop": measured["accuracy_drop"],
        "within_budget": measured["accuracy_drop"] is not None and measured["accuracy_drop"] <= accuracy_budget,
        "error": measured["error"],
        "split": split,
    }


def reevaluation_table(rows: list[dict]) -> str:
    """Markdown: median [min, max] per strategy, then one line per run."""
    lines = ["| strategy | runs | speedup | accuracy drop | within budget |", "|---|---|---|---|---|"]
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == strategy]
        within = sum(r["within_budget"] for r in mine)
        lines.append(
            f"| {strategy} | {len(mine)} | {_cell([r['speedup'] for r in mine], '.2f')} "
            f"| {_cell([r['accuracy_drop'] for r in mine], '.4f')} | {within}/{len(mine)} |"
        )
    greedy = next((r for r in rows if r["strategy"] == "greedy"), None)
    lines += [
        "",
        "| run | speedup | over greedy, round by round | accuracy drop | layers not FP32 | knobs |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        speedup = "failed: " + str(r["error"]) if r["speedup"] is None else f"{r['speedup']:.2f}"
        drop = "-" if r["accuracy_drop"] is None else f"{r['accuracy_drop']:.4f}"
        knobs = ", ".join(f"{k}={v}" for k, v in sorted(r["knobs"].items()))
        lines.append(
            f"| {r['strategy']}-s{r['seed']} | {speedup} | {over_rounds(r, greedy)} | {drop} "
            f"| {r['quantized_layers']}/{r['layers']} | {knobs} |"
        )
    return "\n".join(lines)


def over_rounds(row: dict, base: dict | None) -> str:
    """How much faster ``row`` ran than ``base`` in the rounds they shared.

    The median of the per-round ratios and the rounds in which it was the faster; ``-`` for ``base`` itself or
    without shared rounds.
    """
    rounds = row.get("round_speedups") or []
    compared = None if row is base else compare_rounds(rounds, (base or {}).get("round_speedups") or [])
    return "-" if compared is None else f"{compared[0]:.2f}x ({compared[1]}/{len(rounds)} rounds faster)"


def main() -> int:
    """Runs the benchmark and writes results.json, results.md and best_so_far.png into --out."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--strategies", nargs="+", default=["ppo", "random", "greedy", "optuna", "fp32", "int8"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--budget", type=int, default=150)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--set", action="append", default=[], help="config override for every run")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, each pinned to its own cores")
    parser.add_argument("--cores-per-job", type=int, default=2)
    parser.add_argument("--part", action="store_true", help=argparse.SUPPRESS)  # one run of a --jobs benchmark
    parser.add_argument(
        "--report", action="store_true", help="run nothing: tabulate the runs in --out as far as they got"
    )
    parser.add_argument(
        "--reevaluate",
        action="store_true",
        help="measure every finished run's winner again here, side by side (held-out, confirmation protocol)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [
        (strategy, seed)
        for strategy in args.strategies
        for seed in (args.seeds[:1] if strategy in FIXED + DETERMINISTIC else args.seeds)
    ]
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    if args.reevaluate:
        rows = reevaluate(args, runs)
        (args.out / "reevaluated.json").write_text(json.dumps(rows, indent=2, default=str))
        text = (
            f"Winners re-measured {_here()}), side by side in the same rounds, "
            f"{rows[0]['split'] if rows else 'held-out'} split, confirmation protocol: `{command}`\n\n"
            f"{reevaluation_table(rows)}\n"
        )
        (args.out / "reevaluated.md").write_text(text)
        print(text)
        return 0
    if args.report:
        found = [run_one(args.config, *run, args.budget, args.out, args.set, report=True) for run in runs]
        results = [r for r in found if r is not None]
        unfinished = [f"{r['strategy']}-s{r['seed']} ({r['builds']} builds)" for r in results if not r["finished"]]
        machine = args.out / "machine.txt"  # written where the runs ran (tools/offline/cpu_bench.sh)
        header = f"Report of the runs in {args.out}: `{command}`\n\n"
        if machine.exists():
            header += "Measured on:\n\n```\n" + machine.read_text().strip() + "\n```\n\n"
        if unfinished:
            header += f"Unfinished: {', '.join(unfinished)}.\n\n"
        write_report(args, results, header)
        return 0
    if args.part:
        ((strategy, seed),) = runs
        result = run_one(args.config, strategy, seed, args.budget, args.out, args.set)
        _part_path(args.out, strategy, seed).write_text(json.dumps(result, indent=2, default=str))
        return 0
    if args.jobs > 1:
        (args.out / "parts").mkdir(exist_ok=True)
        # fixed references first: the first run makes the shared caches alone
        runs.sort(key=lambda run: run[0] not in FIXED)
        results = run_parallel(args, runs)
    else:
        results = []
        for strategy, seed in runs:
            print(f"[bench] {strategy} seed {seed}", flush=True)
            results.append(run_one(args.config, strategy, seed, args.budget, args.out, args.set))
            (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    header = (
        f"Measured {_here()}"
        f"{f'; {args.jobs} runs at a time, {args.cores_per_job} cores each' if args.jobs > 1 else ''}); "
        f"budget {args.budget} builds.\n\nCommand: `{command}`\n\n"
    )
    write_report(args, results, header)
    return 0


def write_report(args: argparse.Namespace, results: list[dict], header: str) -> None:
    """Writes results.md (``header``, the 98% target, the table) and best_so_far.png into ``args.out``."""
    markdown, target = table(results, args.budget)
    plot(results, args.budget, args.out / "best_so_far.png", f"{Path(args.config).stem}: best-so-far reward")
    text = f"{header}98% target reward {target:.3f}.\n\n{markdown}\n"
    (args.out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
