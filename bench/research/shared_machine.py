"""FP32 against itself and all-INT8, five runs in a row, beside a busy process and without one.

What a user who tunes on a shared machine gets from one command: each condition runs
``autotune evaluate CONFIG --plan fp32 --plan int8 --plan fp32 --split holdout --json`` five times, each a fresh
process, while one other CPU-bound process (``python -c 'while True: pass'``, one thread) runs at nice 0, at nice 10,
or not at all. It prints, per condition, the FP32 rows (each against the reference: 1 when the timing is true), the
all-INT8 rows, and what the command said about the machine (the ``autotune: note:`` line on stderr).

    python bench/research/shared_machine.py configs/cnn-cpu.yaml --out bench/results/shared_machine.json

``--tune-pair`` instead runs two tuning runs of the config at once (``autotune tune CONFIG --set name=...-a`` and
``-b``, so they share the cores), keeps what each said about the machine, and then re-measures both winners side by
side, quiet, in one ``autotune evaluate`` of 20 rounds: two runs that each measured right beside the other should
export winners that are level.

    python bench/research/shared_machine.py configs/cnn-cpu.yaml --tune-pair --out bench/results/shared_tune_pair.json

docs/benchmarks.md ("Timing on a shared machine") cites its output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CONDITIONS = {"quiet": None, "busy loop, nice 0": 0, "busy loop, nice 10": 10}
"""Condition name to the competing process's niceness; None: no competing process."""
BUSY_LOOP = "while True: pass"


def evaluate_once(config: str, extra: list[str]) -> dict:
    """One fresh ``autotune evaluate`` process: its FP32 and INT8 rows, its note, and its wall time."""
    command = [sys.executable, "-m", "autotune", "evaluate", config, "--plan", "fp32", "--plan", "int8", "--plan"]
    command += ["fp32", "--split", "holdout", "--json", *extra]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall_s = time.perf_counter() - started
    notes = [line for line in done.stderr.splitlines() if line.startswith("autotune: note:")]
    try:
        rows = json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"error": done.stderr.strip().splitlines()[-1:] or ["no output"], "wall_s": wall_s}
    speedups = [row.get("speedup") for row in rows]
    return {
        "fp32": [speedups[0], speedups[2]],
        "int8": speedups[1],
        "busy": rows[0].get("busy"),
        "note": notes[0] if notes else None,
        "wall_s": wall_s,
    }


def run_condition(config: str, niceness: int | None, runs: int, extra: list[str]) -> list[dict]:
    """``runs`` evaluations in a row beside a busy loop of this niceness (None: none)."""
    competitor = None
    if niceness is not None:
        competitor = subprocess.Popen(
            [sys.executable, "-c", BUSY_LOOP], preexec_fn=lambda: os.nice(niceness) if niceness else None
        )
    try:
        return [evaluate_once(config, extra) for _ in range(runs)]
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()


def tune_pair(config: str, extra: list[str]) -> dict:
    """Two tuning runs at once, then their winners side by side on the machine they leave quiet."""
    name = Path(config).stem
    runs = [f"{name}-shared-a", f"{name}-shared-b"]
    started = time.perf_counter()
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "autotune", "tune", config, "--set", f"name={run}", "--no-progress", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for run in runs
    ]
    outputs = [process.communicate() for process in processes]
    wall_s = time.perf_counter() - started
    said = {
        run: [line for line in err.splitlines() if line.startswith("autotune: note:")]
        + [line for line in out.splitlines() if line.startswith("note:")]
        for run, (out, err) in zip(runs, outputs, strict=True)
    }
    summaries = {run: json.loads((Path("runs") / run / "best" / "summary.json").read_text()) for run in runs}
    plans = [item for run in runs for item in ("--plan", f"runs/{run}/best/plan.json")]
    command = [sys.executable, "-m", "autotune", "evaluate", config, *plans, "--plan", "int8", "--split", "holdout"]
    again = subprocess.run([*command, "--json", "--set", "measure.rounds=20"], capture_output=True, text=True)
    rows = json.loads(again.stdout)
    return {
        "wall_s": round(wall_s, 1),
        "said": said,
        "busy": {run: summaries[run].get("busy") for run in runs},
        "winners_in_their_runs": {run: summaries[run]["winner"]["speedup"] for run in runs},
        "re_measured_quiet": {"a": rows[0]["speedup"], "b": rows[1]["speedup"], "int8": rows[2]["speedup"]},
        "a_over_b_quiet": rows[0]["speedup"] / rows[1]["speedup"],
        "quiet_note": next((line for line in again.stderr.splitlines() if "autotune: note:" in line), None),
    }


def summarize(results: list[dict]) -> dict:
    """The condition's FP32 rows, INT8 rows, their spread, and how many runs said the machine was busy."""
    measured = [r for r in results if "error" not in r]
    fp32 = [value for r in measured for value in r["fp32"] if value]
    int8 = [r["int8"] for r in measured if r["int8"]]
    trusted = [r for r in measured if not (r["busy"] and not r["busy"].get("quiet", True))]
    trusted_fp32 = [value for r in trusted for value in r["fp32"] if value]
    trusted_int8 = [r["int8"] for r in trusted if r["int8"]]
    return {
        "fp32_rows": [round(value, 3) for value in fp32],
        "int8_rows": [round(value, 3) for value in int8],
        "runs_said_busy": sum(1 for r in measured if r["note"]),
        "runs_said_too_busy": len(measured) - len(trusted),
        "trusted_fp32_range": [min(trusted_fp32), max(trusted_fp32)] if trusted_fp32 else None,
        "trusted_int8_max_over_min": max(trusted_int8) / min(trusted_int8) if trusted_int8 else None,
        "errors": [r["error"] for r in results if "error" in r],
        "wall_s": [round(r["wall_s"], 1) for r in results],
    }


def main() -> None:
    """Runs every condition and prints one block each; ``--out`` keeps the raw rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--condition", action="append", choices=list(CONDITIONS), help="default: all three")
    parser.add_argument("--set", action="append", default=[], help="passed on to autotune evaluate")
    parser.add_argument("--tune-pair", action="store_true", help="two tuning runs at once, then their winners")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    extra = [item for value in args.set for item in ("--set", value)]
    if args.tune_pair:
        report = {"command": " ".join(sys.argv), **tune_pair(args.config, extra)}
        print(json.dumps(report, indent=2))
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")
        return
    report = {"command": " ".join(sys.argv), "cpus": sorted(os.sched_getaffinity(0)), "conditions": {}}
    for name in args.condition or list(CONDITIONS):
        results = run_condition(args.config, CONDITIONS[name], args.runs, extra)
        report["conditions"][name] = {"summary": summarize(results), "runs": results}
        print(f"{name}: {json.dumps(report['conditions'][name]['summary'])}", flush=True)
        for result in results:
            if result.get("note"):
                print(f"    {result['note']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
