"""``backend.name: auto``: the CPU runtime a run tunes on, chosen by timing each installed runtime's seeds.

Before the run starts, every installed CPU runtime (ONNX Runtime; OpenVINO where its extra is installed) builds
the run's uniform seeds (FP32, all-INT8, all-BF16 where offered) as a run on it would (the same model, search
space, INT8 scheme and calibration, cached for the run that follows), and all of them are timed side by side in
the same rounds against ONNX Runtime's FP32 model (``autotune.measure.timing.side_by_side``). A free knob that the
model's ops invite (``Knob.needs_ops``: ONNX Runtime's SkipLayerNormalization fusion) can be worth more than the
margins below, so each seed is built with its other values too (:func:`fusion_variants`). The run tunes on the
runtime whose fastest seed is fastest; ONNX Runtime, the default, keeps a tie (``TIE_MARGIN``). Where one runtime
leads clearly in the first rounds (``CLEAR_LEAD``), the rest are not timed. The choice is one line on stderr and
``backend_choice`` in ``summary.json``.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from autotune.backends import Backend, BackendUnavailable, BuildError
from autotune.config.schema import BackendConfig
from autotune.data import Dataset
from autotune.extras import MissingExtra
from autotune.measure.quiet_rounds import ReferencePace
from autotune.measure.timing import Latency, Protocol, side_by_side
from autotune.model.layers import LoadedModel
from autotune.plan import PRECISIONS, KnobValue, Plan
from autotune.search.space import SearchSpace

log = logging.getLogger(__name__)

AUTO = "auto"
"""The ``backend.name`` that asks for the choice."""

CPU_RUNTIMES = ("onnxruntime", "openvino")
"""The runtimes ``auto`` chooses among, the default first."""

LABELS = {"onnxruntime": "ONNX Runtime", "openvino": "OpenVINO"}

SEEDS = PRECISIONS
"""The uniform plans timed on each runtime where it offers them: what the search starts from there (FP32 and
all-INT8 on an AVX2 CPU; all-BF16 too on OpenVINO where the CPU has BF16)."""

TIE_MARGIN = 0.03
"""Another runtime is chosen over ONNX Runtime only when its fastest seed is this much faster than ONNX Runtime's:
within it, two side-by-side timings of the same engine on a shared 2-core VM differ by noise alone."""

CHOICE_PROTOCOL = Protocol(warmup=1, repeats=3, rounds=5, settle_s=1.0, max_rounds=10, min_sample_ms=1.0)
"""Short: the seeds differ by tens of percent where the runtime matters, and the choice is made before the run's
first minute is out."""

EARLY_ROUNDS = 3
"""The rounds of ``CHOICE_PROTOCOL`` timed first; where one runtime leads by ``CLEAR_LEAD`` in them, the rest are
not timed (:func:`clear_leader`)."""

CLEAR_LEAD = 0.15
"""How far the slowest early round of the leading runtime's fastest seed must be above the fastest round of every
seed of every other runtime for the choice to stop early. Five times ``TIE_MARGIN``, and above the spread of one
short measurement of FP32 against itself on a 2-core AVX2 VM (0.92-1.10): a lead this clear in every round does
not turn into a tie in two more. MiniLM's and the demo CNN's leads there were over 40 %; a YOLO-shaped detector's,
18 %, times the whole protocol."""

CHOICE_SECONDS = 40.0
"""Wall seconds the side-by-side timing may take; after them the rounds timed so far decide."""

Timings = Mapping[str, Mapping[str, float]]
"""Runtime to seed (``fp32``, ``int8``) to its speedup over ONNX Runtime's FP32 model timed in the same rounds."""


@dataclass(frozen=True)
class RuntimeChoice:
    """The runtime a run tunes on and why.

    Attributes:
        runtime: The chosen ``backend.name``.
        line: The one line the run prints.
        speedups: Runtime to seed to its speedup over ONNX Runtime FP32 (``Timings``); empty where nothing was timed.
        skipped: Runtime to why it was not timed (not installed, or its seeds did not build).
    """

    runtime: str
    line: str
    speedups: dict[str, dict[str, float]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``backend_choice`` of ``summary.json``)."""
        return asdict(self)

    def backend_of(self, requested: BackendConfig) -> BackendConfig:
        """The ``backend`` section to run with: the chosen runtime, the other timed ones' one-liners as references."""
        return backend_on(requested, self.runtime, [runtime for runtime in self.speedups if runtime != self.runtime])


def installed_runtimes() -> tuple[list[str], dict[str, str]]:
    """The CPU runtimes importable here, and why each other one is not (a missing package)."""
    found, missing = [], {}
    for name in CPU_RUNTIMES:
        if importlib.util.find_spec(name) is None:
            missing[name] = f"{LABELS[name]} is not installed (pip install 'autotune[{name}]' to compare it)"
        else:
            found.append(name)
    return found, missing


def decide(speedups: Timings, skipped: Mapping[str, str] | None = None) -> RuntimeChoice:
    """The runtime whose fastest seed is fastest, ONNX Runtime on a tie within ``TIE_MARGIN``; with its line.

    Args:
        speedups: Each timed runtime's seeds (``Timings``); ONNX Runtime's, the default, should be among them.
        skipped: Runtimes not timed, and why (said in the line).
    """
    skipped = dict(skipped or {})
    best = {runtime: max(seeds.items(), key=lambda item: item[1]) for runtime, seeds in speedups.items() if seeds}
    default = CPU_RUNTIMES[0]
    chosen = max(best, key=lambda runtime: best[runtime][1], default=default)
    if chosen != default and default in best and best[chosen][1] < best[default][1] * (1 + TIE_MARGIN):
        chosen = default
    if len(best) < 2:
        why = "; ".join(skipped.values()) or "no other CPU runtime to compare"
        line = f"backend auto: {LABELS[chosen]} ({why})"
    else:
        seed, speed = best[chosen]
        others = ", ".join(
            f"{LABELS[runtime]}'s best {seed_label(best[runtime][0])} {best[runtime][1]:.2f}x"
            for runtime in best
            if runtime != chosen
        )
        line = (
            f"backend auto: {LABELS[chosen]}, whose {seed_label(seed)} seed ran {speed:.2f}x ONNX Runtime FP32 "
            f"side by side ({others}); its one-liners and the others' are the references"
        )
    return RuntimeChoice(chosen, line, {r: dict(s) for r, s in speedups.items()}, skipped)


def backend_on(backend: BackendConfig, name: str, references_of: Sequence[str] = ()) -> BackendConfig:
    """The ``backend`` section on the runtime ``name``; ``references_of``: runtimes whose one-liners are references."""
    options = backend.options.model_copy(update={"reference_runtimes": list(references_of)})
    return backend.model_copy(update={"name": name, "options": options})


def choose(
    requested: str,
    measure: Callable[[Sequence[str]], tuple[dict[str, dict[str, float]], dict[str, str]]],
    say: Callable[[str], None] = lambda line: None,
    timed: bool = True,
) -> RuntimeChoice | None:
    """The measured choice (``decide``) where ``backend.name`` is ``auto``; None where it names a runtime.

    Args:
        requested: The config's ``backend.name``.
        measure: Times the seeds of the runtimes named (``Timings``) and says which it could not time
            (:func:`time_seeds` on the run's set-up).
        say: Prints the choice's line.
        timed: False: ONNX Runtime without timing, for a command that only looks at the model (``inspect``).
    """
    if requested != AUTO:
        return None
    runtimes, skipped = installed_runtimes()
    if not timed:
        runtimes, skipped = runtimes[:1], {"auto": "not timed for this command; autotune tune and evaluate time them"}
    speedups: dict[str, dict[str, float]] = {}
    if len(runtimes) > 1:
        timings, failed = measure(runtimes)
        speedups.update(timings)
        skipped.update(failed)
    choice = decide(speedups, skipped)
    say(choice.line)
    return choice


@dataclass(frozen=True)
class SeedSetup:
    """One runtime set up to build the run's seeds as a run on it would (``autotune.api.seed_timings`` sets it up).

    Attributes:
        backend: The runtime's backend.
        model: The model, loaded for it.
        space: The run's search space on it.
        calibration: The calibration split.
        max_ranges: The ``max`` calibration ranges of the model on it (cached for the run that follows).
        workdir: Where the seeds are built.
    """

    backend: Backend
    model: LoadedModel
    space: SearchSpace
    calibration: Dataset
    max_ranges: Callable[[], dict]
    workdir: Path


def time_seeds(
    runtimes: Sequence[str], set_up: Callable[[str], SeedSetup]
) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """Builds the FP32 and all-INT8 seeds on each runtime and times them side by side.

    ONNX Runtime's FP32 reference is the clock every speedup is over. Another runtime whose set-up or seeds fail
    is left out, with the reason (its runtime's own line, never a traceback).

    Args:
        runtimes: The runtimes to time.
        set_up: A runtime's set-up (``SeedSetup``).

    Raises:
        SetupError: ONNX Runtime cannot set the run up (the model, the data): the error the run would stop with.
    """
    from autotune.harness.prepare import SetupError

    engines: dict[tuple[str, str], Callable[[], object]] = {}
    skipped: dict[str, str] = {}
    reference = None
    for runtime in runtimes:
        try:
            seeds = seed_runners(set_up(runtime))
        except (SetupError, BuildError, BackendUnavailable, MissingExtra, RuntimeError) as error:
            if runtime == CPU_RUNTIMES[0]:  # the default: its run would stop with this error, so the choice does
                raise
            skipped[runtime] = f"{LABELS[runtime]} could not build the seeds: {str(error).splitlines()[0]}"
            log.info("backend auto: %s", skipped[runtime])
            continue
        if runtime == CPU_RUNTIMES[0]:  # the clock: 1.0 by definition, not timed against itself
            reference = seeds.pop("fp32")
        engines.update({(runtime, seed): run for seed, run in seeds.items()})
    if reference is None:  # ONNX Runtime was not asked for: nothing is the clock
        return {}, skipped
    keys = list(engines)
    runners = [engines[key] for key in keys]
    stop_at, pace = time.time() + CHOICE_SECONDS, ReferencePace()
    early = replace(CHOICE_PROTOCOL, rounds=EARLY_ROUNDS, max_rounds=2 * EARLY_ROUNDS, stop_at=stop_at)
    rounds = dict(zip(keys, map(_round_speedups, side_by_side(runners, reference, early, pace=pace)), strict=True))
    if clear_leader(rounds) is None and time.time() < stop_at:
        rest = replace(
            CHOICE_PROTOCOL,
            rounds=CHOICE_PROTOCOL.rounds - EARLY_ROUNDS,
            max_rounds=2 * (CHOICE_PROTOCOL.rounds - EARLY_ROUNDS),
            stop_at=stop_at,
        )
        for key, latency in zip(keys, side_by_side(runners, reference, rest, pace=pace), strict=True):
            rounds[key] += _round_speedups(latency)
    speedups: dict[str, dict[str, float]] = {CPU_RUNTIMES[0]: {"fp32": 1.0}}
    for (runtime, seed), ratios in rounds.items():
        speedups.setdefault(runtime, {})[seed] = round(float(np.median(ratios)), 4)
    return speedups, skipped


def _round_speedups(latency: Latency) -> list[float]:
    """A seed's speedup in each round that counted (its speedup alone where none did)."""
    return list(latency.round_speedups) or [latency.speedup]


def clear_leader(rounds: Mapping[tuple[str, str], Sequence[float]]) -> str | None:
    """The runtime that leads every other by ``CLEAR_LEAD`` in every round timed so far, else None.

    The leader is the runtime of the seed with the highest median; it leads clearly where that seed's slowest round
    is ``CLEAR_LEAD`` above the fastest round of every seed of every other runtime. ONNX Runtime's FP32 model, the
    clock, counts as 1.0 in every round.

    Args:
        rounds: ``(runtime, seed)`` to the seed's per-round speedups over ONNX Runtime FP32.
    """
    timed = {key: list(ratios) for key, ratios in rounds.items() if ratios}
    timed.setdefault((CPU_RUNTIMES[0], "fp32"), [1.0])
    best = max(timed, key=lambda key: float(np.median(timed[key])))
    leader = best[0]
    others = [max(ratios) for (runtime, _seed), ratios in timed.items() if runtime != leader]
    if len(timed[best]) < EARLY_ROUNDS or not others:
        return None
    return leader if min(timed[best]) > max(others) * (1 + CLEAR_LEAD) else None


def fusion_variants(space: SearchSpace) -> list[dict[str, KnobValue]]:
    """The other values of the space's free knobs that the model's ops invite (``Knob.needs_ops``), one at a time.

    Such a knob switches a fusion of the model's own ops into one kernel (ONNX Runtime's SkipLayerNormalization:
    with it off, a MiniLM ran 1.12x faster in FP32 and 1.16-1.20x in INT8 on an AMX Xeon), more than ``TIE_MARGIN``
    and near ``CLEAR_LEAD``: the seeds built at its default alone would understate that runtime. The free knobs
    every model has are left to the run, which measures them on its fastest seed
    (``autotune.search.driver.fix_free_knobs``).
    """
    return [
        {knob.name: value}
        for knob in space.free_knobs
        if knob.needs_ops
        for value in knob.values
        if value != knob.default
    ]


def variant_name(seed: str, knobs: Mapping[str, KnobValue]) -> str:
    """A seed built with other knob values, as the timings name it: ``int8 (skip_layer_norm_fusion=False)``."""
    return f"{seed} ({', '.join(f'{name}={value}' for name, value in knobs.items())})"


def seed_label(seed: str) -> str:
    """A seed's name as the choice's line prints it: its precision in capitals, a variant's knobs as they are."""
    precision, _, knobs = seed.partition(" ")
    return f"{precision.upper()} {knobs}" if knobs else precision.upper()


def seed_plans(setup: SeedSetup) -> dict[str, Plan]:
    """The seeds a runtime is timed by, by name.

    FP32 (with the backend's reference knobs), each other uniform precision it offers, and each of them again with
    each knob value of :func:`fusion_variants`.
    """
    backend, space = setup.backend, setup.space
    variants = fusion_variants(space)
    reference_knobs = backend.fp32_reference_knobs()
    plans = {"fp32": space.uniform("fp32", reference_knobs)}
    plans |= {variant_name("fp32", knobs): space.uniform("fp32", {**reference_knobs, **knobs}) for knobs in variants}
    for precision in SEEDS[1:]:
        plan = space.uniform(precision)
        if plan.hash == space.uniform("fp32").hash:  # no such layer here: the FP32 seed stands for it
            continue
        plans[precision] = plan
        plans |= {variant_name(precision, knobs): plan.with_knobs(**knobs) for knobs in variants}
    return plans


def seed_runners(setup: SeedSetup) -> dict[str, Callable[[], object]]:
    """Runs of each seed's engine (:func:`seed_plans`) over two calibration batches, by name, built as a run builds.

    The model, search space and calibration ranges are the run's (the calibration cached for it); the INT8 seed
    takes the ``max`` ranges, not the run's layerwise choices, which move scales, not kernels: the timing is the
    same, and a MiniLM's layerwise calibration alone takes minutes on two cores.

    Raises:
        BuildError: A seed does not build.
    """
    from autotune.quant.lowering import NONE, Quantization

    backend = setup.backend
    artifacts, ranges = {}, None
    for seed, plan in seed_plans(setup).items():
        quantized = any("int8" in precision or "fp8" in precision for _, precision in plan.precisions)
        if quantized and ranges is None:
            ranges = Quantization(setup.max_ranges())
        artifacts[seed] = backend.build(plan, ranges if quantized else NONE, setup.workdir)
    batches = setup.calibration.batches[:2]
    return {
        seed: (lambda artifact=artifact: [backend.run(artifact, batch) for batch in batches])
        for seed, artifact in artifacts.items()
    }
