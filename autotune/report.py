"""``autotune report``: what a run found and how the search went, as report.md and PNG figures."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from autotune.config.schema import RewardConfig
from autotune.headline import headline_lines
from autotune.run.directory import RunDir
from autotune.run.files import atomic_write
from autotune.run.store import TrialStore
from autotune.run.trial import TrialResult
from autotune.search.estimate import fit_additive
from autotune.search.reward import meets_budget, reward
from autotune.search.select import pareto_front, ranking

FIGURE_SIZE = (8.0, 5.0)
DPI = 100
REFERENCE_MARKERS = ("P", "X", "v", "^", "<", ">")
"""Markers of the backend's one-liners in the Pareto plot, in the order they were measured."""
PRECISION_COLOURS = {
    "fp32": "#9e9e9e",
    "fp16": "#64b5f6",
    "bf16": "#4db6ac",
    "int8": "#ef6c00",
    "int8-dynamic": "#ffb74d",
    "fp8": "#ab47bc",
}


@dataclass
class RunData:
    """One run as the report needs it: its records, and the few settings that score them."""

    run: RunDir
    name: str
    """The run's name (``name``)."""
    metric: str
    """The accuracy metric's name (``metric.name``)."""
    accuracy_budget: float
    """The largest accuracy drop allowed (``accuracy_budget``)."""
    reward: RewardConfig
    """How each trial was rewarded (``reward``)."""
    trials: list[TrialResult]
    confirmations: dict[str, TrialResult]
    summary: dict | None
    references: dict[str, TrialResult] = field(default_factory=dict)
    """The backend's one-liners, measured like the finalists (held-out data, confirmation protocol)."""

    @property
    def label(self) -> str:
        """The run's name."""
        return self.name

    def rewards(self) -> list[float]:
        """Reward of every trial, in build order."""
        return [reward(t, self.reward, self.accuracy_budget) for t in self.trials]


def load_run(path: str | Path) -> RunData:
    """Reads a run directory."""
    run, config = RunDir.open(path)
    with TrialStore(run.store) as store:
        trials = list(store.trials())
        confirmations = store.confirmations()
        references = store.references()
    summary = json.loads(run.summary.read_text()) if run.summary.exists() else None
    scoring = (config.name, config.metric.name, config.accuracy_budget, config.reward)
    return RunData(run, *scoring, trials, confirmations, summary, references)


def _layer_shares(run: RunDir) -> dict[str, float]:
    """Each layer's share of the FP32 model's runtime, profiled afresh with the run's config."""
    from autotune.api import analyze

    _, config = RunDir.open(run.root)
    model, _ = analyze(config)
    return {layer.name: layer.runtime_share or 0.0 for layer in model.layers}


def _machine_lines(summary: dict) -> list[str]:
    """The CPU the run measured on, its INT8 ISA features and the INT8 scheme the probe chose there."""
    lines = []
    machine = summary.get("machine")
    if machine:
        isa = ", ".join(machine.get("isa") or []) or "none listed"
        lines.append(f"- machine: {machine.get('cpu')}, {machine.get('cores')} cores; INT8 ISA features: {isa}")
    arithmetic = summary.get("int8_arithmetic")
    if arithmetic:
        low, high = arithmetic["weight_range"]
        verdicts = "; ".join(arithmetic.get("verdicts", {}).values())
        lines.append(f"- INT8 scheme: {arithmetic['scheme']} (weights in [{low}, {high}]); kernel probe: {verdicts}")
        winner = arithmetic.get("winner_scheme", arithmetic["scheme"])
        if winner != arithmetic["scheme"]:  # the run searched int8_scheme, and another exact scheme won
            lines.append(f"- the winner's INT8 scheme: {winner} (`int8_scheme` searched)")
    return lines


def layer_sensitivities(data: RunData) -> dict[str, float]:
    """Per-layer accuracy drop estimated from all successful trials, assuming drops add up across layers.

    Drops of per-layer INT8 choices are close to additive, so the agent's least-squares fit
    (``autotune.search.estimate.fit_additive``) of ``drop = sum of the quantized layers' sensitivities`` over the
    trials gives each layer's cost; a tiny ridge only keeps it solvable.
    """
    if not data.trials:
        return {}
    names = [name for name, _ in data.trials[0].plan.precisions]
    estimates = fit_additive(names, data.trials, ridge=1e-6, min_trials=1)
    return dict(zip(names, estimates.drop.tolist(), strict=True)) if estimates else {}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_pareto(data: RunData, path: Path) -> None:
    """Every trial as speedup against accuracy drop, the Pareto front, the budget, and the reference plans."""
    plt = _plt()
    figure, axes = plt.subplots(figsize=FIGURE_SIZE, dpi=DPI)
    ok = [t for t in data.trials if t.ok]
    axes.scatter([t.speedup for t in ok], [t.accuracy_drop for t in ok], s=14, alpha=0.5, label="trials (search data)")
    front = sorted((t.speedup, t.accuracy_drop) for t in pareto_front(ok))
    if front:
        axes.step(*zip(*front, strict=True), where="post", color="black", linewidth=1, label="Pareto front")
    axes.axhline(data.accuracy_budget, color="red", linestyle="--", linewidth=1, label="accuracy budget")
    axes.scatter([1.0], [0.0], marker="s", s=60, color="black", label="FP32 (the reference)", zorder=3)
    all_int8 = [t for t in ok if {p for _, p in t.plan.precisions} == {"int8"}]
    if all_int8:
        best = max(all_int8, key=lambda t: t.speedup)
        axes.scatter([best.speedup], [best.accuracy_drop], marker="D", s=60, color="tab:red", label="all-INT8")
    for index, (name, result) in enumerate(data.references.items()):
        if result.ok:
            axes.scatter(
                [result.speedup],
                [result.accuracy_drop],
                marker=REFERENCE_MARKERS[index % len(REFERENCE_MARKERS)],
                s=90,
                color="tab:purple",
                edgecolor="black",
                zorder=4,
                label=f"{name} (one-liner, held-out)",
            )
    if data.summary:
        winner = data.summary["winner"]
        axes.scatter(
            [winner["speedup"]],
            [winner["accuracy_drop"]],
            marker="*",
            s=220,
            color="gold",
            edgecolor="black",
            zorder=4,
            label="winner (confirmed, held-out)",
        )
    axes.set_xlabel("speedup over FP32 (x, measured interleaved)")
    axes.set_ylabel(f"accuracy drop ({data.metric}, metric units)")
    axes.set_title(f"{data.label}: {len(data.trials)} trials")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="best")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def plot_best_so_far(runs: list[RunData], path: Path) -> None:
    """Best-so-far reward against builds, one line per run."""
    plt = _plt()
    figure, axes = plt.subplots(figsize=FIGURE_SIZE, dpi=DPI)
    for data in runs:
        curve = np.maximum.accumulate(data.rewards()) if data.trials else []
        axes.plot(np.arange(1, len(curve) + 1), curve, label=data.label)
    axes.set_xlabel("builds")
    axes.set_ylabel("best-so-far reward (log speedup - penalty)")
    axes.set_title("search progress")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def plot_layers(
    data: RunData, winner: dict[str, str], sensitivities: dict[str, float], shares: dict[str, float], path: Path
) -> None:
    """The winner's precision per layer in graph order, with each layer's sensitivity and share of FP32 time."""
    plt = _plt()
    names = list(winner)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(max(8.0, 0.22 * len(names) + 2), 6), dpi=DPI, sharex=True)
    x = np.arange(len(names))
    colours = [PRECISION_COLOURS.get(winner[n], "black") for n in names]
    top.bar(x, [100 * shares.get(n, 0.0) for n in names], color=colours)
    top.set_ylabel("share of FP32 time (%)")
    top.set_title(f"{data.label}: winner's precision per layer (colour)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for p, c in PRECISION_COLOURS.items() if p in winner.values()]
    top.legend(handles, [p for p in PRECISION_COLOURS if p in winner.values()], fontsize=8, loc="upper right")
    bottom.bar(x, [sensitivities.get(n, 0.0) for n in names], color=colours)
    bottom.set_ylabel("est. drop if INT8")
    bottom.set_xlabel("tunable layer (graph order)")
    bottom.set_xticks(x, [str(i) for i in x], fontsize=7)
    for axes in (top, bottom):
        axes.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _markdown(data: RunData, sensitivities: dict[str, float], shares: dict[str, float], figures: list[str]) -> str:
    ok = [t for t in data.trials if t.ok]
    within = [t for t in ok if meets_budget(t, data.accuracy_budget)]
    lines = [f"# Report: {data.label}", ""]
    lines += [
        f"- trials built: {len(data.trials)} ({len(data.trials) - len(ok)} failed); within the accuracy budget: "
        f"{len(within)}",
        f"- accuracy budget: {data.accuracy_budget} ({data.metric})",
    ]
    if data.summary:
        winner = data.summary["winner"]
        lines.append(
            f"- winner: {_fmt(winner['speedup'], '.3f')}x, drop {_fmt(winner['accuracy_drop'], '.5f')} "
            f"on held-out data ({data.summary['plan']})"
        )
        lines += [f"- {line}" for line in data.summary.get("headline") or headline_lines(data.summary)]
        lines += _self_check_lines(data.summary)
        lines += _machine_lines(data.summary)
    lines += ["", *[f"![{Path(f).stem}]({Path(f).name})" for f in figures], ""]
    noise = ((data.summary or {}).get("self_check") or {}).get("confirmation", {}).get("noise", 0.0)
    ranked = ranking(list(data.confirmations.values()), data.accuracy_budget, noise)
    winner_plan = ranked[0].plan if ranked else None
    lines += [
        "## Confirmed plans (held-out data, longer protocol)",
        "",
        "| rank | plan | speedup | drop | within budget | differs from the winner in |",
        "|---|---|---|---|---|---|",
    ]
    for rank, result in enumerate(ranked, 1):
        diff = winner_plan.diff(result.plan) if winner_plan else []
        diff_text = "; ".join(diff[:6]) + (f"; ... ({len(diff)} in all)" if len(diff) > 6 else "") or "(winner)"
        lines.append(
            f"| {rank} | `{result.plan.hash}` | {_fmt(result.speedup, '.3f')} | {_fmt(result.accuracy_drop, '.5f')} "
            f"| {'yes' if meets_budget(result, data.accuracy_budget) else 'no'} | {diff_text} |"
        )
    lines += _reference_lines(data, ranked[0] if ranked else None)
    if winner_plan is not None:
        lines += [
            "",
            "## Winner per layer",
            "",
            "| # | layer | precision | share of FP32 time | est. drop if INT8 |",
            "|---|---|---|---|---|",
        ]
        for index, (name, precision) in enumerate(winner_plan.precisions):
            lines.append(
                f"| {index} | {name} | {precision} | {_fmt(100 * shares.get(name, 0.0), '.1f')}% "
                f"| {_fmt(sensitivities.get(name), '.2e')} |"
            )
    return "\n".join(lines) + "\n"


def _self_check_lines(summary: dict) -> list[str]:
    """The run's timing self-checks (FP32 against itself), and the note when one left its band."""
    checks = summary.get("self_check") or {}
    read = [f"{checks[where]['ratio']:.3f}x ({where})" for where in ("search", "confirmation") if checks.get(where)]
    if not read:
        return []
    lines = [f"- timing self-check, FP32 against itself: {', '.join(read)}"]
    if summary.get("timing_note"):
        lines.append(f"- note: {summary['timing_note']}")
    return lines


def _reference_lines(data: RunData, winner: TrialResult | None) -> list[str]:
    """The one-liners' table: each measured like the finalists, beside the winner (rank 1)."""
    if not data.references:
        return []
    budget = data.accuracy_budget
    # Backends with a back-to-back timer (Backend.time_back_to_back) get the second timing in two more columns.
    back_to_back = bool(winner and winner.back_to_back_ms)
    header = "| one-liner | speedup | drop | within budget | winner's speedup over it |"
    if back_to_back:
        header += " ms one launch | ms back to back | winner over it back to back |"
    lines = [
        "",
        "## The platform's one-liners (held-out data, longer protocol)",
        "",
        header,
        "|---" * header.count(" | ") + "|---|",
    ]
    if back_to_back and winner is not None:
        lines.append(
            f"| (the winner) | {_fmt(winner.speedup, '.3f')} | {_fmt(winner.accuracy_drop, '.5f')} | - | - "
            f"| {_fmt(winner.latency_ms, '.3f')} | {_fmt(winner.back_to_back_ms, '.3f')} | - |"
        )
    for name, result in data.references.items():
        if not result.ok:
            error = (result.error or "failed").strip().splitlines()[-1].replace("|", "/")
            lines.append(f"| {name} | failed: {error} | - | no | - |" + (" - | - | - |" if back_to_back else ""))
            continue
        ratio = winner.speedup / result.speedup if winner and winner.speedup and result.speedup else None
        row = (
            f"| {name} | {_fmt(result.speedup, '.3f')} | {_fmt(result.accuracy_drop, '.5f')} "
            f"| {'yes' if meets_budget(result, budget) else 'no'} | {_fmt(ratio, '.3f')} |"
        )
        if back_to_back and winner is not None:
            pipelined = result.back_to_back_ms / winner.back_to_back_ms if result.back_to_back_ms else None
            row += (
                f" {_fmt(result.latency_ms, '.3f')} | {_fmt(result.back_to_back_ms, '.3f')} "
                f"| {_fmt(pipelined, '.3f')} |"
            )
        lines.append(row)
    if data.summary and data.summary.get("reference_note"):
        lines += ["", f"Note: {data.summary['reference_note']}."]
    return lines


def report(run_dirs: list[str | Path], profile: bool = True) -> dict[str, Path]:
    """Writes report.md and the figures into the first run directory.

    Args:
        run_dirs: One or more run directories; the first is reported on, all are overlaid in the progress plot.
        profile: Profile the FP32 model for each layer's share of runtime.

    Returns:
        Paths of what was written.
    """
    runs = [load_run(path) for path in run_dirs]
    data = runs[0]
    out = data.run.root
    shares = _layer_shares(data.run) if profile else {}
    sensitivities = layer_sensitivities(data)
    paths = {"pareto": out / "pareto.png", "progress": out / "progress.png"}
    plot_pareto(data, paths["pareto"])
    plot_best_so_far(runs, paths["progress"])
    winner = data.summary and data.confirmations.get(data.summary["plan_hash"])
    if winner:
        paths["layers"] = out / "layers.png"
        plot_layers(data, winner.plan.precision_map, sensitivities, shares, paths["layers"])
    paths["report"] = out / "report.md"
    figures = [str(p) for key, p in paths.items() if key != "report"]
    atomic_write(paths["report"], _markdown(data, sensitivities, shares, figures))
    return paths
