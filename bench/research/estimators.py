"""Which latency estimator holds beside a busy process: one trace of real rounds, every estimator on the same rounds.

One process builds FP32 (the reference), a second FP32 session and all-INT8 of a config, then times them as the
search's protocol does (rotated rounds, ``warmup`` then ``repeats`` runs of each, the scheduler's run-queue wait read
per round) for ``--seconds``, optionally beside a busy loop (``--busy-nice``). The trace is then cut into windows of
``--window`` rounds, one window standing for one measurement, and every estimator reads the same windows:

- ``paired``: the protocol's rule (``autotune.measure.quiet_rounds.quiet_rows``: rounds without run-queue wait, the reference
  within ``quiet_band`` of the process's fastest round, no plan over ``OUTLIER_BAND`` above its lower quartile),
  the median of the per-round ratios over the first ``rounds`` such rounds;
- ``floors``: over the rounds without run-queue wait, each runner by the median of its ``rounds`` fastest round
  medians, the ratio of those (``autotune.measure.timing._from_floors`` on the clear rounds);
- ``floors-all``: the same over every round, waited or not;
- ``fresh``: each window a process of its own, as ``autotune evaluate`` is (its first measurement counts every
  quiet round of its settling): the reference's pace is the window's own fastest round;
- ``remembered``: the same, the pace starting from the fastest round of the last ``KEEP_PROCESSES`` windows
  before it (``autotune.measure.pace``); a window with fewer than ``rounds`` quiet rounds is one that
  would have waited for the spell to end, and is counted as ``waited``.

FP32 against itself must read 1; the spread of all-INT8 over the windows is what a user sees run to run.

    python bench/research/estimators.py configs/cnn-cpu.yaml --seconds 60 --busy-nice 10 --out trace.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

BUSY_LOOP = "while True: pass"


def trace(config_path: str, seconds: float) -> dict:
    """Per round: each runner's run times (reference, FP32 again, all-INT8) and the round's run-queue wait."""
    from autotune.config.schema import load_config
    from autotune.harness import TrialRunner
    from autotune.measure.interference import Sampler

    config = load_config(config_path, [])
    runner = TrialRunner(config)
    feeds = runner.datasets["holdout"].batches[0]
    engines = [runner.reference] + [runner.build(runner.space.uniform(p), config.run_dir) for p in ("fp32", "int8")]
    warmup, repeats = config.measure.warmup, config.measure.repeats
    sampler = Sampler()
    rounds, waits = [], []
    end = time.perf_counter() + seconds
    first = last = sampler.snapshot()
    while time.perf_counter() < end:
        times: list[list[float]] = [[] for _ in engines]
        for index in [(len(rounds) + k) % len(engines) for k in range(len(engines))]:
            for _ in range(warmup):
                runner.backend.time_run(engines[index], feeds)
            times[index] = [runner.backend.time_run(engines[index], feeds) for _ in range(repeats)]
        now = sampler.snapshot()
        reading = sampler.reading(last, now)
        last = now
        rounds.append(times)
        waits.append(None if reading is None else reading.waited)
    whole = sampler.reading(first, last)
    others = None if whole is None else whole.others
    return {"rounds": rounds, "waits": waits, "others": others, "protocol": config.measure.model_dump()}


def estimates(data: dict, window: int) -> dict[str, dict[str, list[float]]]:
    """Each estimator's FP32-over-itself and INT8 ratios, one per window of ``window`` rounds."""
    from autotune.measure.pace import KEEP_PROCESSES
    from autotune.measure.quiet_rounds import ReferencePace, quiet_rows

    def _quiet_rounds(medians: np.ndarray, clear: list[int], band: float | None, pace_ms: float) -> list[int]:
        """The rounds quiet for every plan, judged against a quiet pace of ``pace_ms`` (as a fresh process would)."""
        rows = quiet_rows(medians, clear, band, ReferencePace(remembered_ms=pace_ms if np.isfinite(pace_ms) else None))
        return sorted(set.intersection(*map(set, rows)))

    protocol = data["protocol"]
    medians = np.array([[np.median(runs) for runs in round_] for round_ in data["rounds"]]).T  # runner x round
    waits = data["waits"]
    busy_wait = protocol["busy_wait"] or 1.0
    need = protocol["rounds"]
    names = ("paired", "floors", "all", "fresh", "remembered")
    out: dict[str, dict[str, list[float]]] = {name: {"fp32": [], "int8": []} for name in names}
    out["remembered"]["waited"] = []
    fastest_reference = np.inf
    window_fastest: list[float] = []
    for start in range(0, medians.shape[1] - window + 1, window):
        span = range(start, start + window)
        own_fastest = float(medians[0, start : start + window].min())
        fastest_reference = min(fastest_reference, own_fastest)
        clear = [i for i in span if waits[i] is None or waits[i] <= busy_wait]
        quiet = _quiet_rounds(medians, clear, protocol["quiet_band"], fastest_reference)[:need]
        if len(quiet) >= need:
            _append_ratios(out["paired"], medians, quiet)
        _append_ratios(out["fresh"], medians, _quiet_rounds(medians, clear, protocol["quiet_band"], own_fastest))
        remembered = min(window_fastest[-KEEP_PROCESSES:], default=own_fastest)
        quiet = _quiet_rounds(medians, clear, protocol["quiet_band"], min(remembered, own_fastest))
        if len(quiet) >= need:
            _append_ratios(out["remembered"], medians, quiet)
        else:
            out["remembered"]["waited"].append(float(start))
        window_fastest.append(own_fastest)
        for name, rows in (("floors", clear), ("all", list(span))):
            if len(rows) < need:
                continue
            floors = np.sort(medians[:, rows], axis=1)[:, :need]
            ratio = np.median(floors[0] / floors[1:], axis=1)
            out[name]["fp32"].append(float(ratio[0]))
            out[name]["int8"].append(float(ratio[1]))
    return out


def _append_ratios(rows: dict[str, list[float]], medians: np.ndarray, quiet: list[int]) -> None:
    """FP32-over-itself and INT8 ratios, the median over the ``quiet`` rounds, where there are any."""
    if quiet:
        ratios = medians[0, quiet] / medians[1:, quiet]
        rows["fp32"].append(float(np.median(ratios[0])))
        rows["int8"].append(float(np.median(ratios[1])))


WAIT_BINS = ((0.0, 0.005), (0.005, 0.02), (0.02, 0.05), (0.05, 0.1), (0.1, 0.3), (0.3, float("inf")))
"""Run-queue wait per wall second, by which the rounds are grouped in ``by_wait``."""


def by_wait(data: dict) -> list[dict[str, float | int]]:
    """Per bin of the rounds' run-queue wait: how many rounds, their FP32-over-itself and INT8 ratios (medians).

    Shows whether the scheduler's wait tells the rounds that a competing process slowed from the others.
    """
    medians = np.array([[np.median(runs) for runs in round_] for round_ in data["rounds"]])  # round x runner
    waits = np.array([np.nan if wait is None else wait for wait in data["waits"]])
    rows = []
    for low, high in WAIT_BINS:
        chosen = (waits >= low) & (waits < high)
        if chosen.any():
            ratios = medians[chosen, :1] / medians[chosen, 1:]
            rows.append(
                {
                    "wait": f"[{low}, {high})",
                    "rounds": int(chosen.sum()),
                    "fp32": round(float(np.median(ratios[:, 0])), 3),
                    "int8": round(float(np.median(ratios[:, 1])), 3),
                    "fp32_ms": round(float(np.median(medians[chosen, 0])), 3),
                    "int8_ms": round(float(np.median(medians[chosen, 2])), 3),
                }
            )
    return rows


def summary(values: list[float]) -> dict[str, float | int]:
    """Count, range, and the largest distance from 1 (FP32) or max over min (INT8)."""
    if not values:
        return {"windows": 0}
    return {"windows": len(values), "min": min(values), "max": max(values), "max_over_min": max(values) / min(values)}


def main() -> None:
    """Traces, with or without a competing busy loop, and prints each estimator's spread over the windows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--window", type=int, default=16, help="rounds per simulated measurement")
    parser.add_argument("--busy-nice", type=int, default=None, help="run a busy loop at this niceness beside it")
    parser.add_argument("--out", help="write the trace and the estimates as JSON")
    parser.add_argument("--from-trace", help="read the trace of an earlier --out instead of tracing")
    args = parser.parse_args()
    if args.from_trace:
        with open(args.from_trace) as file:
            data = json.load(file)
        args.busy_nice = data.get("busy_nice")
    else:
        competitor = None
        if args.busy_nice is not None:
            competitor = subprocess.Popen(["nice", "-n", str(args.busy_nice), sys.executable, "-c", BUSY_LOOP])
        try:
            data = trace(args.config, args.seconds)
        finally:
            if competitor is not None:
                competitor.kill()
    windows = estimates(data, args.window)
    results = {
        name: {k: summary(v) if k != "waited" else len(v) for k, v in rows.items()} for name, rows in windows.items()
    }
    # The first window has no earlier one to remember: what a machine's first process gets.
    results["remembered"]["int8_after_first"] = summary(windows["remembered"]["int8"][1:])
    results["remembered"]["fp32_after_first"] = summary(windows["remembered"]["fp32"][1:])
    head = {"busy_nice": args.busy_nice, "rounds": len(data["rounds"]), "others": data.get("others")}
    print(json.dumps({**head, **results, "by_wait": by_wait(data)}, indent=1))
    if args.out and not args.from_trace:
        with open(args.out, "w") as file:
            json.dump({"busy_nice": args.busy_nice, "estimates": results, **data}, file)


if __name__ == "__main__":
    main()
