r"""Our plans against the one-liners (``model.to(dtype)`` + ``torch.compile(mode="reduce-overhead")``), per config.

Usage (on the GPU machine, from the repository root, after ``bash bench/device_wheels.sh install``):
    PYTHONPATH=.device/site:. python bench/gpu_oneliners.py configs/minilm-gpu.yaml configs/minilm-gpu-b64.yaml \
        configs/minilm-gpu-b256.yaml --minilm-dir .device/minilm --out $OUT

Per config, one ``TrialRunner`` in this process prepares the model, calibration and the FP32 reference (compiled,
in one CUDA graph, TF32 off). Every row is built once and measured on the held-out split with the config's
confirmation protocol, interleaved with FP32: the one-liners (``TorchBackend.build_reference``: ``torch-tf32``,
``torch-fp16``, ``torch-bf16``) and the plans of ``--plans``. Then, interleaved head to head in the same process:

- the winner (the fastest plan within the accuracy budget) against the fastest one-liner;
- the uniform FP16 plan (``fp16``: the whole module in FP16) against the FP16 one-liner;
- the exported winner: ``TorchBackend.export`` of the winner, rebuilt with ``load_exported`` and compiled and
  captured with the winner's knobs, against the fastest one-liner (its outputs must equal the winner's).

A head-to-head ``ratio`` is the one-liner's latency over ours (median of per-round ratios): >= 1.00 means ours is
at least as fast. Plan specs: ``PRECISION[@REGEX][:knob=value,...]``: the layers matching ``REGEX`` (all when
left out) take ``PRECISION``, the others the plan's base precision (``base_precision``, which a uniform plan
sets to ``PRECISION`` where it is one; ``autotune.search.space.SearchSpace.uniform``). A spec ending in ``.json``
is a plan file, such as the ``best/plan.json`` of an ``autotune tune`` run.

Writes ``oneliners.json`` and ``oneliners.md`` into ``--out`` after every row; a failure is a row with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu import _first_line, environment, log, parse_knobs, use_repository_paths  # noqa: E402

REFERENCES = ("torch-tf32", "torch-fp16", "torch-bf16")
FFN = r"intermediate/|layer\.\d+/output/"
"""MiniLM's FFN GEMMs (up and down projections), its largest: the 12 of 36 layers where FP8 saves the most."""
PLANS = (
    "fp16:base_precision=fp32",  # the old uniform FP16 plan: only the 36 MatMuls in FP16
    "fp16",
    "bf16",
    "fp16:attention=sdpa",
    "bf16:attention=sdpa",
    "fp8:base_precision=fp16,attention=sdpa",
    "fp8:base_precision=bf16,attention=sdpa",
    f"fp8@{FFN}:base_precision=fp16,attention=sdpa",
)


def resolve(spec: str, space: Any) -> Any:
    """The plan of a spec ``PRECISION[@REGEX][:knob=value,...]``.

    Raises:
        ValueError: An unknown precision, or a plan outside the space.
    """
    if spec.endswith(".json"):  # a plan file: the plan.json of a run's exported winner
        from autotune.plan import Plan

        stored = Plan.from_json(Path(spec).read_text())
        plan = space.plan(stored.precision_map, stored.knob_map)
        problems = space.violations(plan)
        if problems:
            raise ValueError("; ".join(problems))
        return plan
    head, _, knob_text = spec.partition(":")
    precision, _, pattern = head.partition("@")
    knobs = parse_knobs([item for item in knob_text.split(",") if item]) if knob_text else {}
    uniform = space.uniform(precision, knobs)
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


def write(results: dict[str, Any], out: Path) -> None:
    """Writes ``oneliners.json`` and ``oneliners.md``, each replaced whole."""
    for name, text in (
        ("oneliners.json", json.dumps(results, indent=2, default=str)),
        ("oneliners.md", markdown(results)),
    ):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(results: dict[str, Any]) -> str:
    """Rows per config (speedup against FP32), then the head-to-head ratios."""
    env = results.get("environment", {})
    lines = [
        f"Measured {results.get('date', '?')} on {env.get('device', 'no CUDA device')}, torch {env.get('torch', '?')}, "
        f"CUDA {env.get('cuda', '?')}, transformers {env.get('transformers', '?')}.",
        "",
        f"Command: `{results.get('command', '')}`",
        "",
        "| config | row | status | latency ms (IQR) | FP32 ms | vs FP32 | drop | budget | cosine | build s "
        "| plan / error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results.get("rows", []):
        latency = row.get("latency_ms")
        within = row.get("within_budget")
        lines.append(
            "| "
            + " | ".join(
                [
                    row["config"],
                    row["row"],
                    row["status"],
                    "-" if latency is None else f"{latency:.4f} ({_cell(row.get('latency_iqr_ms'), '.4f')})",
                    _cell(row.get("reference_latency_ms"), ".4f"),
                    "-" if row.get("speedup") is None else f"{row['speedup']:.3f}x",
                    _cell(row.get("accuracy_drop"), ".5f"),
                    "-" if within is None else ("yes" if within else "NO"),
                    _cell((row.get("fidelity") or {}).get("cosine"), ".6f"),
                    _cell(row.get("build_s"), ".1f"),
                    (_first_line(row.get("error")) or row.get("plan_summary", "")).replace("|", "\\|")[:140],
                ]
            )
            + " |"
        )
    lines += [
        "",
        "Head to head, interleaved in one process (ratio = the one-liner's latency over ours; >= 1.00: ours is as "
        "fast or faster):",
        "",
        "| config | ours | one-liner | timing | ours ms | one-liner ms | ratio | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for match in results.get("head_to_head", []):
        lines.append(
            f"| {match['config']} | {match['ours']} | {match['oneliner']} | {match.get('timing', 'one launch')} | "
            f"{_cell(match.get('ours_ms'), '.4f')} | "
            f"{_cell(match.get('oneliner_ms'), '.4f')} | {_cell(match.get('ratio'), '.3f')} | "
            f"{(_first_line(match.get('error')) or match.get('note', '')).replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


class Bench:
    """One config's runner, its built rows (kept for the head-to-heads) and the results they go into."""

    def __init__(self, config: Any, results: dict[str, Any], out: Path):
        from autotune.harness import TrialRunner
        from autotune.harness.runner import confirmation_protocol

        self.config, self.results, self.out = config, results, out
        self.runner = TrialRunner(config)
        self.backend = self.runner.backend
        self.protocol = confirmation_protocol(config)
        self.paces: dict[str, Any] = {}  # each one-liner's pace as the reference of its head-to-heads
        self.artifacts: dict[str, Any] = {}
        self.plans: dict[str, Any] = {}
        self.rows: dict[str, dict[str, Any]] = {}

    def measure(self, name: str, build: Any, plan: Any = None) -> None:
        """Builds one row, scores it on the held-out split and times it interleaved with FP32."""
        from autotune.measure import interleaved
        from autotune.metrics import fidelity, score

        runner, split = self.runner, "holdout"
        row: dict[str, Any] = {"config": self.config.name, "row": name, "status": "ok", "error": None}
        if plan is not None:
            row.update(plan_hash=plan.hash, plan_summary=plan.describe(), plan=json.loads(plan.to_json()))
        started = time.perf_counter()
        try:
            artifact = build()
            row["build_s"] = time.perf_counter() - started
            data = runner.datasets[split]
            outputs = [self.backend.run(artifact, batch)[runner.output_index] for batch in data.batches]
            metric = self.config.metric
            accuracy = score(metric.name, outputs, runner.reference_outputs[split], data.labels, metric.function)
            feeds = data.batches[0]
            latency = interleaved(
                lambda: self.backend.time_run(artifact, feeds),
                lambda: self.backend.time_run(runner.reference, feeds),
                self.protocol,
                self_timed=True,
                pace=runner.pace,
            )
            drop = runner.reference_accuracy[split] - accuracy
            row.update(
                latency_ms=latency.median_ms,
                latency_iqr_ms=latency.iqr_ms,
                reference_latency_ms=latency.reference_median_ms,
                speedup=latency.speedup,
                accuracy=accuracy,
                accuracy_drop=drop,
                within_budget=bool(drop <= self.config.accuracy_budget),
                fidelity=fidelity(outputs, runner.reference_outputs[split]),
                knobs=dict(artifact.knobs),
                choices=dict(artifact.choices),
            )
            self.artifacts[name] = artifact
            if plan is not None:
                self.plans[name] = plan
        except Exception as error:  # noqa: BLE001 - a failed row is data, not a crash
            row.update(status="error", error=f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
        row["total_s"] = time.perf_counter() - started
        self.rows[name] = row
        self.results["rows"].append(row)
        write(self.results, self.out)

    def head_to_head(self, ours: str, oneliner: str, note: str = "", artifact: Any = None, pipelined: int = 0) -> None:
        """Times our row against a one-liner, interleaved; ratio = one-liner ms / ours.

        Args:
            ours: Our row's name.
            oneliner: The one-liner's row name.
            note: What the match shows.
            artifact: Ours, when it is not a row (the exported winner).
            pipelined: 0: one launch per timing, synchronised (the harness's protocol: a request's latency,
                host overhead included). N > 0: N launches back to back per timing, divided by N (the host runs
                ahead of the GPU, so per-call host overhead hides behind the previous call's kernels).
        """
        from dataclasses import replace

        from autotune.measure import ReferencePace, interleaved

        match: dict[str, Any] = {"config": self.config.name, "ours": ours, "oneliner": oneliner, "note": note}
        match["timing"] = f"pipelined x{pipelined}" if pipelined else "one launch"
        try:
            mine = artifact if artifact is not None else self.artifacts[ours]
            theirs = self.artifacts[oneliner]
            feeds = self.runner.datasets["holdout"].batches[0]
            if pipelined:
                protocol = replace(self.protocol, warmup=2, repeats=max(5, self.protocol.repeats // 5))
                pace = self.paces.setdefault(f"{oneliner} x{pipelined}", ReferencePace())
                latency = interleaved(
                    lambda: self.pipelined(mine, feeds, pipelined),
                    lambda: self.pipelined(theirs, feeds, pipelined),
                    protocol,
                    self_timed=True,
                    pace=pace,
                )
            else:
                latency = interleaved(
                    lambda: self.backend.time_run(mine, feeds),
                    lambda: self.backend.time_run(theirs, feeds),
                    self.protocol,
                    self_timed=True,
                    pace=self.paces.setdefault(oneliner, ReferencePace()),
                )
            match.update(
                ours_ms=latency.median_ms,
                oneliner_ms=latency.reference_median_ms,
                ratio=latency.speedup,
                round_ratios=list(latency.round_speedups),
            )
        except Exception as error:  # noqa: BLE001
            match["error"] = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
        self.results["head_to_head"].append(match)
        write(self.results, self.out)

    def pipelined(self, artifact: Any, feeds: Any, launches: int) -> float:
        """Milliseconds per launch of ``launches`` launches back to back (events around all, one sync)."""
        import torch

        from autotune.backends.torch.runtime import apply_flags

        if feeds is not artifact.staged:
            self.backend.time_run(artifact, feeds)  # stages the feeds (untimed here)
        apply_flags(artifact)
        with torch.no_grad():
            if artifact.stream is None:
                start = time.perf_counter()
                for _ in range(launches):
                    artifact.launch()
                return (time.perf_counter() - start) * 1e3 / launches
            start_event, end_event = artifact.events
            with torch.cuda.stream(artifact.stream):
                start_event.record(artifact.stream)
                for _ in range(launches):
                    artifact.launch()
                end_event.record(artifact.stream)
            end_event.synchronize()
            return float(start_event.elapsed_time(end_event)) / launches

    def exported(self, name: str) -> Any:
        """The winner through ``export`` and ``load_exported``, compiled and captured with its knobs again.

        Raises:
            AssertionError: The rebuilt module's outputs differ from the winner's.
        """
        import numpy as np

        from autotune.backends.torch import load_exported
        from autotune.backends.torch.runtime import make_artifact

        artifact, plan = self.artifacts[name], self.plans[name]
        with tempfile.TemporaryDirectory() as folder:
            files = self.backend.export(artifact, plan, Path(folder))
            self.results["configs"][self.config.name]["exported_files"] = [Path(f).name for f in files]
            module = load_exported(folder, self.backend.device)
        rebuilt = make_artifact(
            module, self.runner.model.inputs, self.backend.device, dict(artifact.knobs), self.backend._output_shapes
        )
        feeds = self.runner.datasets["holdout"].batches[0]
        want, got = self.backend.run(artifact, feeds)[0], self.backend.run(rebuilt, feeds)[0]
        # Same weights and kernels; a recompile may pick other GEMM tactics, so allow rounding-level differences.
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-3)
        return rebuilt


def run_config(path: str, args: argparse.Namespace, results: dict[str, Any], started: float) -> None:
    """Every row and head-to-head of one config."""
    from autotune.config import load_config

    config = load_config(path, [f"runs_dir={args.out / 'runs'}", *args.set])
    name = config.name
    log(f"{name}: preparing the runner (model, calibration, FP32 reference)", started)
    setup = time.perf_counter()
    bench = Bench(config, results, args.out)
    space = bench.runner.space
    results["configs"][name] = {
        "path": path,
        "setup_s": time.perf_counter() - setup,
        "accuracy_budget": config.accuracy_budget,
        "protocol": bench.protocol.to_dict(),
        "knobs": {k.name: list(k.values) for k in space.knobs},
        "references": list(bench.backend.references()),
    }
    log(
        f"{name}: ready in {results['configs'][name]['setup_s']:.1f} s; knobs {results['configs'][name]['knobs']}",
        started,
    )

    def out_of_time() -> bool:
        return args.time_limit is not None and time.perf_counter() - started > args.time_limit

    for reference in args.references:
        if out_of_time():
            break
        if reference not in results["configs"][name]["references"]:
            log(f"{name} {reference}: not offered on this device", started)
            continue
        bench.measure(reference, lambda r=reference: bench.backend.build_reference(r, [], args.out))
        _log_row(bench.rows[reference], started)
    for spec in args.plans:
        if out_of_time():
            break
        try:
            plan = resolve(spec, space)
        except Exception as error:  # noqa: BLE001
            bench.rows[spec] = row = {"config": name, "row": spec, "status": "error", "error": str(error)}
            results["rows"].append(row)
            continue
        bench.measure(spec, lambda p=plan: bench.runner.build(p, config.run_dir), plan)
        _log_row(bench.rows[spec], started)
    compare(bench, args, out_of_time, started)


def compare(bench: Bench, args: argparse.Namespace, out_of_time: Any, started: float) -> None:
    """The head-to-heads of one config: the winner and the uniform FP16 plan against the one-liners."""
    name, results = bench.config.name, bench.results
    ok = [row for row in bench.rows.values() if row["status"] == "ok"]
    oneliners = [row for row in ok if row["row"] in REFERENCES and row["within_budget"]]
    ours = [row for row in ok if row["row"] not in REFERENCES and row["within_budget"]]
    if not oneliners or not ours:
        log(f"{name}: no head-to-head (one-liners {len(oneliners)}, plans {len(ours)} within budget)", started)
        return
    best_oneliner = max(oneliners, key=lambda row: row["speedup"])["row"]
    winner = max(ours, key=lambda row: row["speedup"])["row"]
    results["configs"][name].update(winner=winner, best_oneliner=best_oneliner)
    fp16 = "fp16" in bench.artifacts and "torch-fp16" in bench.artifacts
    bench.head_to_head(winner, best_oneliner, "the winner against the fastest one-liner")
    if fp16:
        bench.head_to_head("fp16", "torch-fp16", "uniform FP16 plan against the FP16 one-liner")
    if args.pipelined:
        for row in oneliners:
            bench.head_to_head(winner, row["row"], "the winner, launches back to back", pipelined=args.pipelined)
        if fp16:
            bench.head_to_head("fp16", "torch-fp16", "uniform FP16, back to back", pipelined=args.pipelined)
    if args.export and not out_of_time():
        try:
            rebuilt = bench.exported(winner)
            bench.head_to_head(winner + " (exported)", best_oneliner, "export + load_exported + compile", rebuilt)
        except Exception as error:  # noqa: BLE001
            results["head_to_head"].append(
                {"config": name, "ours": winner + " (exported)", "oneliner": best_oneliner, "error": repr(error)}
            )
            write(results, args.out)
    for match in results["head_to_head"]:
        if match["config"] == name:
            log(
                f"{name}: {match['ours']} vs {match['oneliner']} ({match.get('timing')}): ratio {match.get('ratio')}",
                started,
            )


def _log_row(row: dict[str, Any], started: float) -> None:
    if row["status"] == "ok":
        log(
            f"{row['config']} {row['row']}: {row['latency_ms']:.4f} ms vs FP32 {row['reference_latency_ms']:.4f} "
            f"({row['speedup']:.3f}x), drop {row['accuracy_drop']:.5f}, build {row['build_s']:.1f} s",
            started,
        )
    else:
        log(f"{row['config']} {row['row']}: error: {_first_line(row['error'])}", started)


def main(argv: list[str] | None = None) -> int:
    """Measures every config; writes oneliners.json and oneliners.md into --out."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", help="config YAML files (backend torch)")
    parser.add_argument("--plans", nargs="+", default=list(PLANS), help="plan specs (see above)")
    parser.add_argument("--references", nargs="*", default=list(REFERENCES), help="one-liners to measure")
    parser.add_argument("--out", type=Path, required=True, help="folder for the results")
    parser.add_argument("--set", action="append", default=[], help="config override for every config (key=value)")
    parser.add_argument("--minilm-dir", type=Path, help="sets AUTOTUNE_MINILM_DIR (a folder written by minilm pack)")
    parser.add_argument("--time-limit", type=float, help="seconds after which no new row is started")
    parser.add_argument(
        "--pipelined", type=int, default=0, help="also time head-to-heads with N launches back to back (0: off)"
    )
    parser.add_argument(
        "--no-export", dest="export", action="store_false", help="skip the exported winner's head-to-head"
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    use_repository_paths()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.minilm_dir is not None:
        os.environ["AUTOTUNE_MINILM_DIR"] = str(args.minilm_dir.resolve())
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python "
        + " ".join(shlex.quote(a) for a in (sys.argv if argv is None else ["bench/gpu_oneliners.py", *argv])),
        "environment": environment(),
        "configs": {},
        "rows": [],
        "head_to_head": [],
    }
    write(results, args.out)
    for path in args.configs:
        if args.time_limit is not None and time.perf_counter() - started > args.time_limit:
            log(f"{path}: skipped, --time-limit reached", started)
            continue
        try:
            run_config(path, args, results, started)
        except Exception as error:  # noqa: BLE001 - the next config still runs
            results["rows"].append(
                {"config": Path(path).stem, "row": "*", "status": "error", "error": traceback.format_exc()}
            )
            log(f"{path}: {type(error).__name__}: {error}", started)
        write(results, args.out)
    results["wall_s"] = time.perf_counter() - started
    write(results, args.out)
    print(markdown(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
