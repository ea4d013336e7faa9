r"""A guard against benchmark regressions: compare re-measured winners with a stored benchmark.

Usage (before a release, on a quiet machine):
    python bench/run.py configs/minilm-cpu.yaml --strategies int8 fp32 ppo greedy --seeds 0 1 2 --budget 150 \
        --out NEW --reevaluate     # after the runs themselves (the same command without --reevaluate)
    python bench/compare.py NEW/reevaluated.json bench/results/minilm-cpu/reevaluated.json

Each file is what ``bench/run.py --reevaluate`` writes: per run, the exported winner re-measured on held-out data.
Per strategy the median speedup of the runs within the accuracy budget is compared with the stored one. The
allowed fall is the measured run-to-run noise of the stored benchmark, never less than the measurement noise of
the protocol:

- the spread of that strategy's runs (half the range of their speedups, relative to the median), and
- the FP32 plan re-measured against itself, in the stored benchmark and in the new one
  (``autotune.measure.confidence.SelfCheck.noise``: its distance from 1 and half the spread of its rounds): what one
  measurement may be off by. A fall inside it is a tie, not a regression.

A strategy whose runs all missed the budget, or that failed where the stored one succeeded, is a regression too.
Exit code 1 names every regressed strategy and figure; 0 prints the comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from autotune.measure.confidence import SelfCheck

MIN_NOISE = 0.02
"""A floor for the allowed fall: a benchmark of one seed per strategy still measures with some noise."""


def _within(rows: list[dict], strategy: str) -> list[float]:
    return [r["speedup"] for r in rows if r["strategy"] == strategy and r.get("within_budget") and r["speedup"]]


def self_check_noise(rows: list[dict]) -> float:
    """The largest noise of a benchmark's FP32 rows timed against FP32 (0 without one)."""
    checks = [
        SelfCheck.of(r["speedup"], r.get("round_speedups") or [])
        for r in rows
        if r["strategy"] == "fp32" and r["speedup"]
    ]
    return max((check.noise for check in checks), default=0.0)


def noise(stored: list[dict], strategy: str, current: list[dict] | None = None) -> float:
    """The relative fall of ``strategy``'s median speedup that the benchmarks' own noise explains."""
    floor = max(MIN_NOISE, self_check_noise(stored), self_check_noise(current or []))
    speedups = _within(stored, strategy)
    if len(speedups) >= 2:
        floor = max(floor, (max(speedups) - min(speedups)) / 2 / statistics.median(speedups))
    return floor


def regressions(current: list[dict], stored: list[dict]) -> list[str]:
    """One line per strategy whose confirmed result fell by more than the stored benchmark's noise."""
    found = []
    for strategy in dict.fromkeys(r["strategy"] for r in stored):
        if strategy == "fp32":
            continue
        before, now = _within(stored, strategy), _within(current, strategy)
        if not before:
            continue  # nothing within budget to keep
        if not any(r["strategy"] == strategy for r in current):
            found.append(f"{strategy}: missing from the new benchmark (stored median {statistics.median(before):.2f}x)")
            continue
        if not now:
            old = statistics.median(before)
            found.append(f"{strategy}: no run within the accuracy budget (stored median {old:.2f}x)")
            continue
        allowed = noise(stored, strategy, current)
        old, new = statistics.median(before), statistics.median(now)
        if new < old * (1.0 - allowed):
            found.append(
                f"{strategy}: median speedup within budget {new:.2f}x, stored {old:.2f}x "
                f"(fell {100 * (1 - new / old):.1f} %, noise allows {100 * allowed:.1f} %)"
            )
    return found


def _median(speedups: list[float]) -> str:
    return f"{statistics.median(speedups):.2f}x" if speedups else "-"


def main(argv: list[str] | None = None) -> int:
    """Compares two ``reevaluated.json`` files; exit 1 on a regression."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("current", type=Path, help="reevaluated.json of the benchmark just run")
    parser.add_argument("stored", type=Path, help="reevaluated.json of the stored reference benchmark")
    args = parser.parse_args(argv)
    current, stored = (json.loads(path.read_text()) for path in (args.current, args.stored))
    found = regressions(current, stored)
    for strategy in dict.fromkeys(r["strategy"] for r in stored):
        now, before = (_median(_within(rows, strategy)) for rows in (current, stored))
        print(f"{strategy:>10}: now {now:>6}  stored {before:>6}  noise {100 * noise(stored, strategy, current):.1f} %")
    if found:
        print("regressions:\n" + "\n".join(f"  {line}" for line in found), file=sys.stderr)
        return 1
    print("no regression")
    return 0


if __name__ == "__main__":
    sys.exit(main())
