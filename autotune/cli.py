"""The ``autotune`` command: parse, load the config, call the API, print."""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autotune import api
from autotune.config.auto import (
    DEFAULT_ACCURACY_BUDGET,
    DEFAULT_BATCH,
    DEFAULT_METRIC,
    METRICS,
    Draft,
    commented_yaml,
    draft_config,
    parse_shapes,
)
from autotune.config.schema import ConfigError, TuneConfig, apply_overrides, dump_config, load_config, parse_config
from autotune.confirm import export_ranked
from autotune.harness.process import LOG_FORMAT
from autotune.headline import headline_lines
from autotune.measure.confidence import compare_rounds
from autotune.measure.interference import Busy
from autotune.plan import PRECISIONS
from autotune.run.files import atomic_write
from autotune.search.registry import STRATEGIES
from autotune.tune import tune


def _add_config(parser: argparse.ArgumentParser, model_only: bool = False) -> None:
    if model_only:
        parser.add_argument("config", metavar="MODEL", help="an ONNX model file")
    else:
        parser.add_argument("config", help="a YAML config (see configs/), or an ONNX model file with --data")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key, e.g. budget.builds=20"
    )
    model = parser.add_argument_group("a model without a config (MODEL.onnx --data SAMPLES.npz)")
    model.add_argument(
        "--data",
        metavar="NPZ",
        help="samples: one array per model input, named after it, samples first (optionally 'labels'); split in file "
        "order into calibration (first quarter), evaluation (next half) and held-out data (last quarter)",
    )
    model.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="INPUT=DIMS",
        help="an input's shape, e.g. input_ids=8x128 (default: the graph's, its dynamic dimensions from the data, "
        f"a dynamic batch {DEFAULT_BATCH})",
    )
    model.add_argument(
        "--metric",
        choices=METRICS,
        help=f"default {DEFAULT_METRIC} of the first output against FP32; top1 needs 'labels' in the data "
        f"(accuracy budget {DEFAULT_ACCURACY_BUDGET} either way: --set accuracy_budget=...)",
    )


def _is_model_file(path: str) -> bool:
    return Path(path).suffix.lower() == ".onnx"


def _draft(args: argparse.Namespace) -> Draft:
    """The config drafted for ``MODEL.onnx --data NPZ``; its one-line summary goes to the log."""
    if not args.data:
        raise ConfigError(
            f"{args.config} is a model file: give its samples with --data SAMPLES.npz (one array per model input, "
            "named after it), or write a YAML config"
        )
    draft = draft_config(args.config, args.data, parse_shapes(args.shape), args.metric)
    logging.getLogger("autotune").info("%s", draft.summary)
    return draft


def _load(args: argparse.Namespace, before: Sequence[str] = (), after: Sequence[str] = ()) -> TuneConfig:
    """The run's config: a YAML file's, or the one drafted for a model file and its samples; ``--set`` on top."""
    overrides = [*before, *args.set, *after]
    if _is_model_file(args.config):
        return parse_config(apply_overrides(_draft(args).data, overrides), args.config)
    if args.data or args.shape or args.metric:
        raise ConfigError(
            "--data, --shape and --metric go with a model file (autotune tune model.onnx --data samples.npz); "
            f"{args.config} names its data and metric itself (change them with --set)"
        )
    return load_config(args.config, overrides)


def _init(args: argparse.Namespace) -> int:
    if not _is_model_file(args.config):
        raise ConfigError(f"autotune init takes an ONNX model file (model.onnx --data samples.npz), not {args.config}")
    draft = _draft(args)
    data = apply_overrides(copy.deepcopy(draft.data), list(args.set))
    parse_config(data, args.config)  # what is written is valid as it is
    header = (
        f"autotune config for {Path(args.config).name}, written by `autotune init`: `autotune tune` takes it as it "
        "is.\nKeys left out take their defaults (docs/reference/config.md)."
    )
    print(commented_yaml(data, draft.notes, header), end="")
    return 0


def _add_from(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--from",
        dest="from_runs",
        action="append",
        default=[],
        metavar="RUN_DIR",
        help="reuse the trials of an earlier run of the same model, data and machine (no build for those plans)",
    )


def _one_liners() -> str:
    """The one-liners of each backend that names them without starting its runtime, for ``--help``."""
    from autotune.backends.onnxruntime import REFERENCES
    from autotune.backends.openvino.references import REFERENCES as OPENVINO_REFERENCES

    return f"onnxruntime: {', '.join(REFERENCES)}; openvino: {', '.join(OPENVINO_REFERENCES)}"


def _inspect(args: argparse.Namespace) -> int:
    from autotune.measure.selfcheck import say

    config, _ = api.choose_runtime(_load(args), say=say, timed=False)  # backend auto: shown on ONNX Runtime
    model, space = api.analyze(config)
    rows = api.layer_table(model, space)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"{model.path}: {len(rows)} tunable layers, {len(space.searchable)} searched; knobs: "
        + ", ".join(f"{k.name}={list(k.values)}" for k in space.knobs)
    )
    print(
        f"{'#':>3} {'layer':<20} {'MMACs':>9} {'params':>9} {'depth':>5} {'FP32 %':>7}  {'choices':<12} "
        f"{'weight from':<22} name"
    )
    for row in rows:
        share = f"{100 * row['runtime_share']:.1f}" if row["runtime_share"] is not None else "-"
        print(
            f"{row['index']:>3} {row['unit']:<20} {row['macs'] / 1e6:>9.2f} {row['params']:>9} {row['depth']:>5} "
            f"{share:>7}  {'/'.join(row['choices']):<12} {row['weight_source'] or '-':<22} {row['name']}"
        )
    left = api.float_ops(model, config.backend.name)
    if left:
        print(f"left in FP32 ({len(left)}):")
        for op in left:
            print(f"    {op['op_type']} {op['name']}: {op['reason']}")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    config = _load(args)
    specs = args.plan or ["int8"]
    results = api.evaluate_side_by_side(config, specs, split=args.split, isolate=not args.in_process)
    _say_busy(results)
    _say_failed(specs, results)
    if len(results) == 1 or args.json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2))
    else:
        width = max(24, *(len(_plan_label(spec)) for spec in specs))
        header = f"{'plan':<{width}} {'speedup':>8} {'latency ms':>11} {'FP32 ms':>9} {'metric':>9} {'drop':>9}"
        print(f"{header} {'over the first, by round':>25}   ({args.split} data)")
        for spec, row in zip(specs, results, strict=True):
            print(_side_by_side_row(spec, row, results[0], width))
    return 0 if all(result["status"] == "ok" for result in results) else 1


def _say_failed(specs: list[str], results: list[dict]) -> None:
    """One line on stderr per plan that failed (a build error, a runtime that aborted), its error's last line.

    The plans that ran are still reported on stdout; the exit code says that one did not.
    """
    for spec, row in zip(specs, results, strict=True):
        if row.get("status") != "ok":
            error = str(row.get("error") or "no result").strip().splitlines()
            print(f"autotune: plan {_plan_label(spec)} failed: {error[-1] if error else 'no result'}", file=sys.stderr)


def _say_busy(results: list[dict]) -> None:
    """One line on stderr when other work got in the way of the timing (the rows share one measurement)."""
    busy = next((row["busy"] for row in results if row.get("busy")), None)
    if busy is None:
        return
    described = Busy.from_dict(busy)
    if described.shared:
        print(f"autotune: note: {described.describe()}", file=sys.stderr)


def _plan_label(spec: str) -> str:
    """A ``--plan`` as its row names it: a plan file by its file name, a one-liner or uniform plan as given."""
    return Path(spec).name if spec.endswith(".json") else spec


def _side_by_side_row(spec: str, row: dict, first: dict, width: int = 24) -> str:
    """One plan's line; the last column compares it with the first plan, round by round (they shared rounds).

    Args:
        spec: The ``--plan`` of the row.
        row: Its result.
        first: The first plan's result.
        width: The label column's width (the longest label's, at least 24).
    """
    label = _plan_label(spec)
    if row["status"] != "ok" or row.get("speedup") is None:
        error = str(row.get("error") or "no result").strip().splitlines()
        return f"{label:<{width}} failed: {error[-1] if error else 'no result'}"
    rounds = row.get("round_speedups") or []
    compared = None if row is first else compare_rounds(rounds, first.get("round_speedups") or [])
    over = "-" if compared is None else f"{compared[0]:.2f}x, faster in {compared[1]}/{len(rounds)}"
    return (
        f"{label:<{width}} {row['speedup']:>8.2f} {row['latency_ms']:>11.3f} {row['reference_latency_ms']:>9.3f} "
        f"{row['accuracy']:>9.4f} {row['accuracy_drop']:>9.4g} {over:>25}"
    )


def _summary_row(label: str, row: dict, width: int = 12) -> str:
    """One line of the summary table (``width``: its label column's); a failed one-liner shows its error instead."""
    if row.get("status", "ok") != "ok" or row.get("speedup") is None:
        error = str(row.get("error") or "no result").strip().splitlines()
        return f"{label:<{width}} failed: {error[-1] if error else 'no result'}"
    back_to_back = row.get("back_to_back_ms")
    return (
        f"{label:<{width}} {row['speedup']:>8.2f} {row['latency_ms']:>11.3f} {row['accuracy']:>9.4f} "
        f"{row['accuracy_drop']:>9.4g}" + (f" {back_to_back:>11.3f}" if back_to_back else "")
    )


def _print_summary(summary: dict) -> None:
    winner, reference = summary["winner"], summary.get("fp32_reference") or {}
    if summary.get("backend_choice"):
        print(f"\n{summary['backend_choice']['line']}")
    print(f"\nwinner (rank {summary['rank']}): {summary['plan']}")
    pipelined = f" {'ms b2b':>11}" if winner.get("back_to_back_ms") else ""  # 20 launches back to back, per launch
    rows = [("fp32", reference), *(summary.get("references") or {}).items(), ("winner", winner)]
    width = max(12, *(len(label) for label, _ in rows))  # a long one-liner's name (nncf-accuracy-control) fits
    print(
        f"{'':<{width}} {'speedup':>8} {'latency ms':>11} {'metric':>9} {'drop':>9}{pipelined}   "
        "(held-out data, confirmed)"
    )
    for label, row in rows:
        if row:
            print(_summary_row(label, row, width))
    for line in summary.get("headline") or headline_lines(summary):
        print(line)
    if summary.get("reference_note"):
        print(f"note: {summary['reference_note']}")
    check = (summary.get("self_check") or {}).get("confirmation")
    if check:
        print(f"timing self-check: FP32 against itself {check['ratio']:.3f}x in the confirmation")
    if summary.get("timing_note"):
        print(f"note: {summary['timing_note']}")
    print(
        f"accuracy budget {summary['accuracy_budget']} ({summary['metric']}); builds {summary['builds']}, "
        f"store hits {summary['cache_hits']}; exported: {', '.join(summary['files'])}"
    )


def _from_runs(args: argparse.Namespace) -> list[str]:
    """``--from`` as a ``from_runs`` override (after any ``--set``, so the command line wins)."""
    return [f"from_runs={json.dumps(args.from_runs)}"] if args.from_runs else []


def _tune(args: argparse.Namespace) -> int:
    config = _load(args, after=_from_runs(args))
    summary = tune(config, progress=not args.no_progress)
    _print_summary(summary)
    print(f"TensorBoard: tensorboard --logdir {config.run_dir / 'tb'}")
    return 0


def _baseline(args: argparse.Namespace) -> int:
    overrides = [f"budget.builds={args.budget}", f"seed={args.seed}"] if args.budget else [f"seed={args.seed}"]
    config = _load(args, before=overrides, after=_from_runs(args))
    if not any(item.startswith("name=") for item in args.set):
        config = config.model_copy(update={"name": f"{config.name}-{args.strategy}-s{args.seed}"})
    summary = tune(config, strategy=args.strategy, progress=not args.no_progress)
    _print_summary(summary)
    return 0


# What a resumed run may change: how much it spends, how it confirms, where its trials run. Every other key decides
# what its stored trials measured (model, data, backend, search space, protocol, reward) or how its agent was built.
RESUMABLE_SECTIONS = ("budget", "confirm", "execution")


def _resume(args: argparse.Namespace) -> int:
    if args.set:
        _override_run_config(Path(args.run_dir), args.set)
    summary = tune(resume_dir=Path(args.run_dir), progress=not args.no_progress)
    _print_summary(summary)
    return 0


def _override_run_config(run_dir: Path, overrides: list[str]) -> None:
    """Writes ``--set`` overrides into a run's resolved config, so this resume and every later one uses them.

    Raises:
        ConfigError: A key outside ``RESUMABLE_SECTIONS``, or a bad value (nothing is written then).
    """
    from autotune.run.directory import RunDir

    for override in overrides:
        key = override.split("=", 1)[0].strip()
        if key.split(".", 1)[0] not in RESUMABLE_SECTIONS:
            raise ConfigError(
                f"resume --set {key}: a resumed run may change only {', '.join(s + '.*' for s in RESUMABLE_SECTIONS)}; "
                f"to change {key}, start a new run that reuses this one's trials: autotune tune CONFIG --from {run_dir}"
            )
    run, _ = RunDir.open(run_dir)
    atomic_write(run.config, dump_config(load_config(run.config, overrides)))


def _export(args: argparse.Namespace) -> int:
    from autotune.harness import Evaluator
    from autotune.run.directory import RunDir
    from autotune.run.store import TrialStore

    run, config = RunDir.open(args.run_dir)
    with TrialStore(run.store) as store, Evaluator(config, store) as evaluator:
        out_dir = Path(args.out) if args.out else None
        summary = export_ranked(run, evaluator, config.accuracy_budget, config.metric.name, args.rank, out_dir)
    print(json.dumps(summary, indent=2))
    return 0


def _report(args: argparse.Namespace) -> int:
    from autotune.report import report

    paths = report(args.run_dirs)
    for key, path in paths.items():
        print(f"{key}: {path}")
    return 0


def _add_model_commands(commands: Any) -> None:
    """``init``, ``inspect`` and ``evaluate``: a config or a model file, nothing searched."""
    init = commands.add_parser(
        "init", help="print the config `autotune tune MODEL.onnx --data SAMPLES.npz` runs, commented, to edit"
    )
    _add_config(init, model_only=True)
    init.set_defaults(handler=_init)

    inspect = commands.add_parser("inspect", help="print the table of tunable layers")
    _add_config(inspect)
    inspect.add_argument("--json", action="store_true", help="print JSON")
    inspect.set_defaults(handler=_inspect)

    evaluate = commands.add_parser("evaluate", help="build and measure plans against FP32 in the same run")
    _add_config(evaluate)
    evaluate.add_argument(
        "--plan",
        action="append",
        help=f"a precision for every layer ({', '.join(PRECISIONS)}), one of the backend's one-liners "
        f"({_one_liners()}), or a plan JSON file (default int8); repeat it to measure plans side by side: one "
        "process, FP32 and every plan timed in turn in the same rounds",
    )
    evaluate.add_argument("--split", choices=("evaluation", "holdout"), default="evaluation")
    evaluate.add_argument("--json", action="store_true", help="print every result as JSON (one plan: always)")
    evaluate.add_argument(
        "--in-process",
        action="store_true",
        help="build and run in this process, not a child (under qemu-user a child started by exec runs natively)",
    )
    evaluate.set_defaults(handler=_evaluate)


def _add_search_commands(commands: Any) -> None:
    """``tune`` and ``baseline``: a search, confirmed and exported."""
    tune = commands.add_parser("tune", help="train the agent, confirm the finalists, export the winner")
    _add_config(tune)
    tune.add_argument("--no-progress", action="store_true", help="no progress bar or lines, no notes")
    _add_from(tune)
    tune.set_defaults(handler=_tune)

    baseline = commands.add_parser("baseline", help="run a baseline strategy on the same harness as the agent")
    _add_config(baseline)
    baseline.add_argument("--strategy", required=True, choices=list(STRATEGIES))
    baseline.add_argument("--budget", type=int, help="builds (default budget.builds of the config)")
    baseline.add_argument("--seed", type=int, default=0, help="the run's seed; its name ends in -STRATEGY-sSEED")
    baseline.add_argument("--no-progress", action="store_true", help="no progress bar or lines, no notes")
    _add_from(baseline)
    baseline.set_defaults(handler=_baseline)


def _add_run_commands(commands: Any) -> None:
    """``resume``, ``export`` and ``report``: what a run directory is used for later."""
    resume = commands.add_parser("resume", help="continue an interrupted run with its trial store")
    resume.add_argument("run_dir", help="the run's directory, runs/NAME")
    resume.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a key of {', '.join(s + '.*' for s in RESUMABLE_SECTIONS)} for the rest of the run, "
        "e.g. budget.builds=80 to continue a finished run longer",
    )
    resume.add_argument("--no-progress", action="store_true", help="no progress bar or lines, no notes")
    resume.set_defaults(handler=_resume)

    export = commands.add_parser("export", help="export a ranked confirmed plan of a finished run")
    export.add_argument("run_dir", help="a finished run's directory, runs/NAME")
    export.add_argument("--rank", type=int, default=1, help="1 = the winner")
    export.add_argument("--out", help="output folder (default RUN_DIR/best)")
    export.set_defaults(handler=_export)

    report = commands.add_parser("report", help="write report.md and figures into a run directory")
    report.add_argument("run_dirs", nargs="+", help="the run to report on, then runs to overlay in the progress plot")
    report.set_defaults(handler=_report)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="autotune",
        description="The fastest inference engine of a model within an accuracy budget: a precision per layer and "
        "the build's knobs, searched, measured against FP32 and exported.",
        epilog="Your own model: autotune tune MODEL.onnx --data SAMPLES.npz. A shipped example: autotune tune "
        "configs/cnn-cpu.yaml. Every command and flag: docs/reference/cli.md.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    _add_model_commands(commands)
    _add_search_commands(commands)
    _add_run_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; errors a user can fix are printed without a traceback."""
    args = build_parser().parse_args(argv)
    # Progress notes (model export, calibration time) go to stderr unless the run was asked to be quiet.
    quiet = getattr(args, "no_progress", False)
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format=LOG_FORMAT)
    from autotune.backends import BackendUnavailable, BuildError
    from autotune.extras import MissingExtra
    from autotune.harness import SetupError
    from autotune.interrupt import SIGTERM_EXIT_CODE, Terminated, sigterm_interrupts
    from autotune.run.store import StoreError

    try:
        with sigterm_interrupts():  # `kill` or `timeout` stops a run as Ctrl-C does: its time and agent are kept
            return args.handler(args)
    except (ConfigError, SetupError, StoreError, BackendUnavailable, BuildError, MissingExtra) as error:
        print(f"autotune: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a full disk or an unwritable folder: the message names the file and the cause
        print(f"autotune: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:
        print(
            "autotune: interrupted; measured trials are kept: continue with `autotune resume runs/<name>`",
            file=sys.stderr,
        )
        return SIGTERM_EXIT_CODE if isinstance(interrupt, Terminated) else 130


if __name__ == "__main__":
    sys.exit(main())
