"""Each layer's accuracy drop alone in one INT8 form, and the drop of every layer in it: where a budget's drop goes.

Accuracy only, nothing is timed: every plan is built and scored on the evaluation split by the run's own trial runner
(the same calibration, layerwise choices and metric as a run). A form is a precision, with an INT8 scheme after a
colon where the search offers several (``int8:u8s7``). Prints the layers sorted by their drop with the running sum,
and writes the figures as JSON::

    python bench/research/layer_drops.py configs/minilm-cpu.yaml --form int8-dynamic --form int8:u8s7 \\
        --set backend.name=onnxruntime --out bench/results/minilm-layer-drops.json

A layer's drop alone is no exact share of the whole plan's (drops interact), but their sum came within 2 % of the
all-layer drop for MiniLM's 36 MatMuls in both forms above, so the sorted sums say which plans can meet a budget.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from autotune.config.schema import load_config
from autotune.harness.runner import TrialRunner


def form_plan(space, form: str, layers: set[str]):
    """The plan with ``form`` on ``layers`` and FP32 elsewhere (``form`` may name an INT8 scheme: ``int8:u8s7``)."""
    precision, _, scheme = form.partition(":")
    knobs = {"int8_scheme": scheme} if scheme else {}
    return space.plan({name: precision if name in layers else "fp32" for name in space.layer_names}, knobs)


def drop(runner: TrialRunner, plan) -> float | str:
    """The plan's drop on the evaluation split, or its error."""
    scored = runner._build_and_score(plan, "evaluation")
    if not hasattr(scored, "accuracy"):
        return f"failed: {scored.error}"
    return runner.reference_accuracy["evaluation"] - scored.accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--form", action="append", required=True, help="e.g. int8-dynamic, int8:u8s7 (repeat)")
    parser.add_argument("--set", action="append", default=[], help="a config override, as autotune's --set")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runner = TrialRunner(load_config(args.config, args.set))
    space = runner.space
    found = {}
    for form in args.form:
        every = drop(runner, form_plan(space, form, set(space.layer_names)))
        alone = {name: drop(runner, form_plan(space, form, {name})) for name in space.layer_names}
        found[form] = {"all": every, "alone": alone}
        print(f"{form}: every layer {every}")
        total = 0.0
        for name, value in sorted(alone.items(), key=lambda item: item[1] if isinstance(item[1], float) else 1.0):
            total += value if isinstance(value, float) else 0.0
            print(f"  {value if isinstance(value, str) else f'{value:.6f}'}  sum {total:.6f}  {name}")
    if args.out:
        args.out.write_text(json.dumps({"command": vars(args) | {"out": str(args.out)}, "forms": found}, indent=1))


if __name__ == "__main__":
    main()
