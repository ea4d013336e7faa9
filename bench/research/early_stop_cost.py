"""The scoring time the sequential early stop saves: one run's plans scored with and without it, in one process.

Builds each trial of a store once, then scores its engine on the evaluation split with the sequential test
(``metric.early_stop_alpha``) and without it, alternately for ``--rounds`` rounds, timing each scoring in CPU seconds
of this process (``time.process_time``: the backend's threads included), so machine load between commands does not
enter the comparison. Prints per plan: batches scored with the test, the drop either way, the CPU seconds either way;
and the totals. A plan the test does not stop must score the same accuracy either way (checked).

Usage:
    python bench/research/early_stop_cost.py configs/cnn-cpu.yaml --store RUN_DIR/trials.sqlite \
        [--rounds 3] [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from autotune.config.schema import load_config
from autotune.harness.runner import TrialRunner
from autotune.run.store import TrialStore


def _cpu_seconds(runner: TrialRunner, artifact: object, sequential: bool) -> tuple[float, float, int]:
    """The accuracy, CPU seconds and batches of one scoring of ``artifact`` on the evaluation split."""
    start = time.process_time()
    outputs, scoring = runner._scored_outputs(artifact, "evaluation", sequential)
    accuracy = runner._score(outputs, "evaluation", scoring.batches)
    return accuracy, time.process_time() - start, len(scoring.batches or runner.datasets["evaluation"].batches)


def main() -> None:
    """Scores every successful trial of the store both ways and prints the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = parser.parse_args()
    config = load_config(args.config, args.set)
    runner = TrialRunner(config)
    with TrialStore(args.store) as store:
        plans = [trial.plan for trial in store.trials() if trial.ok]
    totals = {True: 0.0, False: 0.0}
    print("plan  batches  drop(test)  drop(whole)  cpu_s(test)  cpu_s(whole)")
    for plan in plans:
        artifact = runner.build(plan, config.run_dir)
        seconds = {True: 0.0, False: 0.0}
        scored = {}
        for _ in range(args.rounds):
            for sequential in (True, False):
                accuracy, cpu_s, batches = _cpu_seconds(runner, artifact, sequential)
                seconds[sequential] += cpu_s / args.rounds
                scored[sequential] = (accuracy, batches)
        (tested, batches), (whole, _) = scored[True], scored[False]
        if batches == len(runner.datasets["evaluation"].batches):
            assert tested == whole, f"{plan.hash}: {tested} != {whole}"
        reference = runner.reference_accuracy["evaluation"]
        drop_tested = reference - tested if batches == len(runner.datasets["evaluation"].batches) else None
        print(
            f"{plan.hash[:8]}  {batches:7d}  {drop_tested if drop_tested is not None else 'stopped':>10}  "
            f"{reference - whole:11.4f}  {seconds[True]:11.3f}  {seconds[False]:12.3f}"
        )
        for key in totals:
            totals[key] += seconds[key]
    print(f"total CPU s per scoring of every plan: with the test {totals[True]:.2f}, whole split {totals[False]:.2f}")


if __name__ == "__main__":
    main()
