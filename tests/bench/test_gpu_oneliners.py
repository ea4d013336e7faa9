"""bench/gpu_oneliners.py's plan specs, on the tiny torch model's search space (no GPU needed)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from gpu_oneliners import resolve  # noqa: E402

from autotune.api import analyze  # noqa: E402
from autotune.testing import tiny_torch_config  # noqa: E402


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    return analyze(tiny_torch_config(tmp_path_factory.mktemp("torch")), profile=False)[1]


def test_a_plan_file_resolves_to_the_plan_it_holds(space, tmp_path):
    first = space.layer_names[0]
    plan = space.plan({first: "fp32"}, {"base_precision": "bf16"})
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    resolved = resolve(str(path), space)
    assert resolved.hash == plan.hash
    assert resolved.precision_map[first] == "fp32" and resolved.knob("base_precision") == "bf16"


def test_a_spec_sets_matching_layers_and_the_base_elsewhere(space):
    first = space.layer_names[0]
    plan = resolve(f"fp16@^{first}$:base_precision=bf16", space)
    assert plan.precision_map[first] == "fp16"
    for name, options in list(zip(space.layer_names, space.choices, strict=True))[1:]:
        assert plan.precision_map[name] == ("bf16" if "bf16" in options else "fp32")
