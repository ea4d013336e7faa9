"""Strategies x seeds on one config with the same build budget: a results table and a best-so-far plot.

Usage:
    python bench/run.py configs/minilm-cpu.yaml --strategies ppo random greedy optuna fp32 int8
        --seeds 0 1 2 --budget 150 --out bench/results/minilm-cpu

Runs share the calibration cache (``cache_dir``) but not the trial store: each strategy pays for its own builds.
Every trial measures its FP32 reference interleaved in the same process, so rewards compare across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from autotune.config import load_config
from autotune.search.reward import meets_budget, reward
from autotune.store import TrialStore
from autotune.tune import tune

FIXED = ("fp32", "int8", "fp16")
DETERMINISTIC = ("greedy",)


def best_so_far(rewards: list[float]) -> list[float]:
    """Running maximum."""
    return list(np.maximum.accumulate(rewards)) if rewards else []


def run_one(config_path: str, strategy: str, seed: int, budget: int, out: Path, overrides: list[str]) -> dict:
    """One strategy and seed; returns its curve and headline numbers."""
    name = f"{strategy}-s{seed}"
    config = load_config(
        config_path, [f"budget.builds={budget}", f"seed={seed}", f"name={name}", f"runs_dir={out / 'runs'}", *overrides]
    )
    run_dir = config.run_dir
    started = time.time()
    if not (run_dir / "summary.json").exists():
        if (run_dir / "trials.sqlite").exists():
            tune(resume_dir=run_dir, progress=False)
        else:
            tune(config, strategy=strategy, progress=False)
    summary = json.loads((run_dir / "summary.json").read_text())
    with TrialStore(run_dir / "trials.sqlite") as store:
        trials = list(store.trials())
        wall_s = float(store.get_meta("wall_s", time.time() - started))
    rewards = [reward(t, config.reward, config.accuracy_budget) for t in trials]
    within = [t for t in trials if meets_budget(t, config.accuracy_budget)]
    best_within = max(within, key=lambda t: t.speedup) if within else None
    return {
        "strategy": strategy,
        "seed": seed,
        "builds": len(trials),
        "curve": best_so_far(rewards),
        "best_reward": max(rewards) if rewards else None,
        "search_best_within_budget": {
            "speedup": best_within.speedup if best_within else None,
            "accuracy_drop": best_within.accuracy_drop if best_within else None,
        },
        "confirmed_winner": summary["winner"],
        "wall_s": wall_s,
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
        "| builds to 98% of best | builds | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for strategy in dict.fromkeys(r["strategy"] for r in results):
        rows = [r for r in results if r["strategy"] == strategy]
        reach = [builds_to_reach(r["curve"], target) for r in rows]
        reach_text = _cell([float(x) for x in reach if x is not None], ".0f")
        if any(x is None for x in reach):
            reach_text += f" ({sum(x is None for x in reach)}/{len(rows)} never)"
        lines.append(
            f"| {strategy} | {len(rows)} | {_cell([r['best_reward'] for r in rows], '.3f')} "
            f"| {_cell([r['confirmed_winner']['speedup'] for r in rows], '.2f')} "
            f"| {_cell([r['confirmed_winner']['accuracy_drop'] for r in rows], '.4f')} "
            f"| {_cell([r['search_best_within_budget']['speedup'] for r in rows], '.2f')} "
            f"| {reach_text} | {_cell([float(r['builds']) for r in rows], '.0f')} "
            f"| {_cell([r['wall_s'] for r in rows], '.0f')} |"
        )
    return "\n".join(lines), target


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


def main() -> int:
    """Runs the benchmark and writes results.json, results.md and best_so_far.png into --out."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--strategies", nargs="+", default=["ppo", "random", "greedy", "optuna", "fp32", "int8"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--budget", type=int, default=150)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--set", action="append", default=[], help="config override for every run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for strategy in args.strategies:
        seeds = args.seeds[:1] if strategy in FIXED + DETERMINISTIC else args.seeds
        for seed in seeds:
            print(f"[bench] {strategy} seed {seed}", flush=True)
            results.append(run_one(args.config, strategy, seed, args.budget, args.out, args.set))
            (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    markdown, target = table(results, args.budget)
    plot(results, args.budget, args.out / "best_so_far.png", f"{Path(args.config).stem}: best-so-far reward")
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    header = (
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.node()} ({platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}); "
        f"budget {args.budget} builds; 98% target reward {target:.3f}.\n\n"
        f"Command: `{command}`\n\n"
    )
    (args.out / "results.md").write_text(header + markdown + "\n")
    print(header + markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
