"""The machine's slow spells, traced: FP32, all-INT8 and a second FP32 session timed one run each, in turn.

What ``measure.quiet_band``, ``measure.settle_s`` and the remembered pace (``autotune.measure.pace``) answer
(docs/benchmarks.md, "Timing"): on a shared VM the host takes a core for spells, some longer than a process of
``autotune evaluate`` times, and a two-thread session's INT8 slows more than its FP32 there, so the ratio moves.
This prints, per 0.1 s block, whether the reference ran within the band of its quiet level (the 10th percentile of
the blocks), how long the slow spells lasted, and the INT8 ratio quiet and in the spells.

    python bench/research/timing_trace.py configs/cnn-cpu.yaml --seconds 50 [--out trace.npy]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def trace(config_path: str, seconds: float) -> np.ndarray:
    """Rows of (time s, FP32 ms, all-INT8 ms, second FP32 ms), one run of each per row."""
    from autotune.config.schema import load_config
    from autotune.harness import TrialRunner

    config = load_config(config_path, [])
    runner = TrialRunner(config)
    feeds = runner.datasets["holdout"].batches[0]
    engines = [runner.reference] + [runner.build(runner.space.uniform(p), config.run_dir) for p in ("int8", "fp32")]
    for engine in engines:
        for _ in range(3):
            runner.backend.run(engine, feeds)
    rows = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        rows.append([time.perf_counter(), *(runner.backend.time_run(engine, feeds) for engine in engines)])
    return np.array(rows)


def spells(rows: np.ndarray, band: float = 0.05, block_s: float = 0.1) -> dict[str, float]:
    """Per ``block_s`` block, quiet or slow by the reference's median; the spells' lengths and both ratios."""
    block = ((rows[:, 0] - rows[0, 0]) / block_s).astype(int)
    medians = np.array([np.median(rows[block == b, 1:3], axis=0) for b in np.unique(block)])
    slow = medians[:, 0] > np.percentile(medians[:, 0], 10) * (1 + band)
    lengths: list[int] = []
    run = 0
    for is_slow in [*slow, False]:
        if is_slow:
            run += 1
        elif run:
            lengths.append(run)
            run = 0
    ratios = medians[:, 0] / medians[:, 1]
    return {
        "slow_fraction": float(slow.mean()),
        "spells": len(lengths),
        "spells_over_5_s": sum(length * block_s > 5.0 for length in lengths),
        "longest_spell_s": max(lengths, default=0) * block_s,
        "fp32_quiet_ms": float(np.median(medians[~slow, 0])),
        "fp32_slow_ms": float(np.median(medians[slow, 0])) if slow.any() else float("nan"),
        "int8_quiet_ms": float(np.median(medians[~slow, 1])),
        "int8_slow_ms": float(np.median(medians[slow, 1])) if slow.any() else float("nan"),
        "int8_ratio_quiet": float(np.median(ratios[~slow])),
        "int8_ratio_slow": float(np.median(ratios[slow])) if slow.any() else float("nan"),
        "fp32_self_ratio": float(np.median(rows[:, 1] / rows[:, 3])),
    }


def main() -> None:
    """Traces the config's model and prints its spells."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--seconds", type=float, default=50.0)
    parser.add_argument("--out", help="save the rows (.npy)")
    args = parser.parse_args()
    rows = trace(args.config, args.seconds)
    if args.out:
        np.save(args.out, rows)
    for key, value in spells(rows).items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")


if __name__ == "__main__":
    main()
