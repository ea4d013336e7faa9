"""How a tuning run scales with trial workers, and what busy neighbours do to a measurement.

Usage (a 16-core host; each call fits in 10 minutes with these budgets; results accumulate in ``--out``; the
commands behind every table are in docs/benchmarks.md), with short trials, so the workers' throughput is measured:
    S="--set measure.rounds=3 --set search.calibration_methods=[max] --set confirm.top_k=1 --set confirm.references=[]"
    python bench/scaling.py configs/minilm-cpu.yaml --workers 8 --budget 160 $S --out bench/results/scaling-minilm-long
    python bench/scaling.py configs/minilm-cpu.yaml --workers 1 --budget 12 $S --out bench/results/scaling-minilm-long
    python bench/scaling.py configs/minilm-cpu.yaml --interference 8 --plans 3 $S --out bench/results/scaling-minilm
    python bench/scaling.py configs/minilm-cpu.yaml --reevaluate --budget 12 $S --out bench/results/scaling-minilm-long
    add --set execution.backend=ray to run the same through Ray actors (a local Ray cluster unless ray_address)

Scaling: one ``autotune baseline``-style run per worker count (same strategy, seed and build budget; every worker
on its own ``--cores-per-worker`` cores). Builds per minute are measured over the search: the builds divided by
the time from the search's start to its last commit, where the start is the first commit less the median trial
time (the workers' preparation, the confirmation and the references are left out). ``ratio`` is that rate over
N x the single-worker rate (the target is >= 0.8).

Interference: the same few plans measured on worker 0 alone, then with the other N - 1 workers building and
measuring random plans the whole time; each measurement interleaves the FP32 reference as every trial does, so
the speedup should hold even where the latency moves.

``--reevaluate`` measures every run's exported winner again on one worker with no other worker busy, all winners
side by side (in the same rounds), on the held-out split with the confirmation protocol: the figure to compare
across worker counts.

Writes ``scaling.json`` and ``scaling.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from autotune.api import analyze
from autotune.config.schema import TuneConfig, load_config
from autotune.harness import Evaluator
from autotune.harness.executor import make_pool
from autotune.harness.runner import confirmation_protocol
from autotune.plan import Plan
from autotune.run.files import write_json
from autotune.run.store import TrialStore
from autotune.run.trial import TrialResult
from autotune.search.episode import decisions, plan_from_actions
from autotune.tune import tune


def worker_config(
    config_path: str, workers: int, cores: int, budget: int, out: Path, overrides: list[str]
) -> TuneConfig:
    """The config of the run with ``workers`` workers: its own run directory under ``out/runs``."""
    return load_config(
        config_path,
        [
            f"execution.workers={workers}",
            f"backend.intra_op_threads={cores}",
            f"budget.builds={budget}",
            f"name=w{workers}",
            f"runs_dir={out / 'runs'}",
            *overrides,
        ],
    )


def search_rate(trials: list[TrialResult], workers: int = 1) -> dict[str, float]:
    """Builds per minute of a search from its trials' commit times (``created_at``) and durations (``total_s``).

    Also what the rate lost is made of: ``trial_s_mean`` (each trial slower beside busy neighbours) and
    ``busy_share``, the workers' time spent in trials over ``workers`` x the search's span (idle at the start and
    the end, or waiting on the driver).
    """
    if not trials:
        return {"builds": 0, "search_s": 0.0, "builds_per_minute": 0.0, "trial_s_mean": 0.0, "busy_share": 0.0}
    times = sorted(t.created_at for t in trials)
    durations = [t.total_s or 0.0 for t in trials]
    span = times[-1] - times[0] + statistics.median(durations)
    return {
        "builds": len(trials),
        "search_s": span,
        "builds_per_minute": 60.0 * len(trials) / span if span else 0.0,
        "trial_s_mean": statistics.mean(durations),
        "busy_share": sum(durations) / (workers * span) if span else 0.0,
    }


def run_scaling(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """One run per worker count; skips a count already in ``results``."""
    for workers in args.workers:
        key = str(workers)
        if key in results["scaling"]:
            continue
        config = worker_config(args.config, workers, args.cores_per_worker, args.budget, args.out, args.set)
        started = time.time()
        if config.run_dir.exists():  # interrupted before: finish it (its time so far is not in wall_s)
            summary = tune(resume_dir=config.run_dir, progress=False)
        else:
            summary = tune(config, strategy=args.strategy, progress=False)
        with TrialStore(config.run_dir / "trials.sqlite") as store:
            trials = list(store.trials())
        results["scaling"][key] = {
            **search_rate(trials, workers),
            "wall_s": time.time() - started,
            "winner_plan_hash": summary["plan_hash"],
            "winner_speedup_confirmed": summary["winner"]["speedup"],
            "winner_drop_confirmed": summary["winner"]["accuracy_drop"],
            "run_dir": str(config.run_dir),
        }
        save(args.out, results)
        print(f"[scaling] {workers} workers: {results['scaling'][key]['builds_per_minute']:.2f} builds/min", flush=True)


def add_ratios(results: dict[str, Any]) -> None:
    """Each worker count's rate over N x the single-worker rate."""
    single = results["scaling"].get("1", {}).get("builds_per_minute")
    for key, row in results["scaling"].items():
        row["ratio"] = row["builds_per_minute"] / (int(key) * single) if single else None


def reevaluate(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Every run's winner measured again on one worker with no other busy, side by side in the same rounds.

    On held-out data, with the confirmation protocol.
    """
    config = worker_config(args.config, 1, args.cores_per_worker, args.budget, args.out, [*args.set, "name=reeval"])
    config = config.model_copy(update={"execution": config.execution.model_copy(update={"backend": "local"})})
    protocol = confirmation_protocol(config.measure, config.confirm)
    with TrialStore(args.out / "reevaluate.sqlite") as store, Evaluator(config, store) as evaluator:
        rows = list(results["scaling"].values())
        plans = [Plan.from_dict(json.loads((Path(row["run_dir"]) / "best" / "plan.json").read_text())) for row in rows]
        for row, result in zip(rows, evaluator.measure_side_by_side(plans, "holdout", protocol), strict=True):
            row["winner_speedup_alone"] = result.speedup
            row["winner_drop_alone"] = result.accuracy_drop


def sample_plans(config: TuneConfig, count: int, seed: int) -> list[Plan]:
    """All-INT8 and ``count - 1`` random plans of the config's search space."""
    _, space = analyze(config, profile=False)
    rng = np.random.default_rng(seed)
    steps = decisions(space)
    plans = [space.uniform("int8")]
    while len(plans) < count:
        plans.append(plan_from_actions(space, steps, [int(rng.integers(len(s.options))) for s in steps]))
    return plans


def measure_with_neighbours(pool: Any, plan: Plan, fillers: list[Plan], busy_neighbours: bool) -> TrialResult:
    """Measures ``plan`` on worker 0; with ``busy_neighbours`` the other workers build fillers all the while."""
    deadlines: dict[int, float] = {}
    timeout = pool.timeout_s
    pool.send(0, "trial", (plan.to_dict(), "evaluation", None))
    deadlines[0] = time.monotonic() + timeout
    next_filler = 0
    target: TrialResult | None = None
    while target is None or len(deadlines) > 0:
        if target is None and busy_neighbours:
            for worker in range(1, pool.size):
                if worker not in deadlines:
                    filler = fillers[next_filler % len(fillers)]
                    next_filler += 1
                    pool.send(worker, "trial", (filler.to_dict(), "evaluation", None))
                    deadlines[worker] = time.monotonic() + timeout
        for worker, (status, data) in pool.collect(deadlines):
            del deadlines[worker]
            if worker == 0:
                target = TrialResult.from_dict(data) if status == "result" else TrialResult.failure(plan, str(data))
    return target


def run_interference(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """The same plans on worker 0 alone and beside N - 1 busy workers, for each N of ``--interference``."""
    for workers in args.interference:
        if str(workers) in results["interference"]:
            continue
        config = worker_config(args.config, workers, args.cores_per_worker, args.budget, args.out, args.set)
        config = config.model_copy(update={"execution": config.execution.model_copy(update={"backend": "local"})})
        plans = sample_plans(config, args.plans, seed=0)
        fillers = sample_plans(config, 8, seed=1)
        pool = make_pool(config)
        pool.start()
        rows = []
        try:
            for plan in plans:
                alone = measure_with_neighbours(pool, plan, fillers, busy_neighbours=False)
                busy = measure_with_neighbours(pool, plan, fillers, busy_neighbours=workers > 1)
                rows.append(
                    {
                        "plan_hash": plan.hash,
                        "latency_ms_alone": alone.latency_ms,
                        "latency_ms_busy": busy.latency_ms,
                        "speedup_alone": alone.speedup,
                        "speedup_busy": busy.speedup,
                    }
                )
        finally:
            pool.close()
        results["interference"][str(workers)] = rows
        save(args.out, results)
        print(f"[interference] {workers} workers: {rows}", flush=True)


def markdown(results: dict[str, Any]) -> str:
    """The scaling table and the interference table."""
    lines = [
        "| workers | builds | search (s) | builds/min | ratio to N x 1 worker | trial s (mean) | busy share | "
        "winner speedup (confirmed) | winner speedup (alone) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def number(value: Any, digits: int = 2) -> str:
        return f"{value:.{digits}f}" if isinstance(value, int | float) else "-"

    for key in sorted(results["scaling"], key=int):
        row = results["scaling"][key]
        lines.append(
            f"| {key} | {row['builds']} | {number(row['search_s'], 0)} | {number(row['builds_per_minute'])} | "
            f"{number(row.get('ratio'))} | {number(row.get('trial_s_mean'))} | {number(row.get('busy_share'))} | "
            f"{number(row['winner_speedup_confirmed'])} | "
            f"{number(row.get('winner_speedup_alone'))} |"
        )
    lines += ["", "| workers | plan | latency alone (ms) | latency busy (ms) | speedup alone | speedup busy |"]
    lines.append("|---|---|---|---|---|---|")
    for key in sorted(results["interference"], key=int):
        for row in results["interference"][key]:
            lines.append(
                f"| {key} | {row['plan_hash'][:10]} | {number(row['latency_ms_alone'], 3)} | "
                f"{number(row['latency_ms_busy'], 3)} | {number(row['speedup_alone'])} | "
                f"{number(row['speedup_busy'])} |"
            )
    lines += ["", f"CPUs: {results.get('cpus', {}).get('summary', '-')}", "", "Commands:"]
    lines += [f"- `{command}`" for command in results.get("commands", [])]
    return "\n".join(lines) + "\n"


def cpu_topology(sysfs: Path = Path("/sys/devices/system/cpu")) -> dict[str, Any]:
    """The CPUs this process may use and which of them share a physical core (Linux sysfs; empty elsewhere).

    Workers on two hyperthreads of one core are not independent, so the scaling table names the topology.
    """
    cpus = sorted(os.sched_getaffinity(0))
    siblings = {}
    for cpu in cpus:
        path = sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        siblings[str(cpu)] = path.read_text().strip() if path.exists() else str(cpu)
    cores = len(set(siblings.values()))
    summary = f"{len(cpus)} CPUs on {cores} physical cores ({len(cpus) // max(cores, 1)} threads each)"
    return {"cpus": len(cpus), "physical_cores": cores, "siblings": siblings, "summary": summary}


def save(out: Path, results: dict[str, Any]) -> None:
    """Writes ``scaling.json`` and ``scaling.md``."""
    add_ratios(results)
    write_json(out / "scaling.json", results)
    (out / "scaling.md").write_text(markdown(results))


def load(out: Path) -> dict[str, Any]:
    """The results so far (a later call adds worker counts to them)."""
    path = out / "scaling.json"
    if path.exists():
        results = json.loads(path.read_text())
        if "command" in results:  # written before every call's command was kept
            results["commands"] = [results.pop("command"), *results.get("commands", [])]
        return results
    return {"scaling": {}, "interference": {}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--workers", type=int, nargs="*", default=[], help="worker counts of the scaling runs")
    parser.add_argument("--interference", type=int, nargs="*", default=[], help="worker counts to measure beside")
    parser.add_argument("--reevaluate", action="store_true", help="re-measure every run's winner alone")
    parser.add_argument("--cores-per-worker", type=int, default=2)
    parser.add_argument("--budget", type=int, default=24, help="builds per scaling run")
    parser.add_argument("--plans", type=int, default=3, help="plans measured for the interference figure")
    parser.add_argument("--strategy", default="random", help="the search of the scaling runs")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Runs what the arguments ask for and prints the tables."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = load(args.out)
    command = shlex.join(["python", *sys.argv]) if argv is None else shlex.join(argv)
    # Results accumulate over calls (one device call fits only some worker counts): keep every call's command.
    results["commands"] = [*results.pop("commands", []), command]
    results["cpus"] = cpu_topology()
    run_scaling(args, results)
    run_interference(args, results)
    if args.reevaluate:
        reevaluate(args, results)
    save(args.out, results)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
