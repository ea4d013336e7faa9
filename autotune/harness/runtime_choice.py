"""``backend.name: auto``: the CPU runtime a run tunes on, chosen by timing each installed runtime's seeds.

Before the run starts, every installed CPU runtime (ONNX Runtime; OpenVINO where its extra is installed) builds
the run's uniform seeds (FP32, all-INT8, all-BF16 where offered) as a run on it would (the same model, search
space, INT8 scheme and calibration, cached for the run that follows), and all of them are timed side by side in
the same rounds against ONNX Runtime's FP32 model (``autotune.measure.timing.side_by_side``). The run tunes on the
runtime whose fastest seed is fastest; ONNX Runtime, the default, keeps a tie (``TIE_MARGIN``). The choice is one
line on stderr and ``backend_choice`` in ``summary.json``.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from autotune.backends import BackendUnavailable, BuildError
from autotune.config.schema import TuneConfig
from autotune.extras import MissingExtra
from autotune.measure.timing import Protocol, side_by_side
from autotune.plan import PRECISIONS, Plan

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
            f"{LABELS[runtime]}'s best {best[runtime][0].upper()} {best[runtime][1]:.2f}x"
            for runtime in best
            if runtime != chosen
        )
        line = (
            f"backend auto: {LABELS[chosen]}, whose {seed.upper()} seed ran {speed:.2f}x ONNX Runtime FP32 "
            f"side by side ({others}); its one-liners and the others' are the references"
        )
    return RuntimeChoice(chosen, line, {r: dict(s) for r, s in speedups.items()}, skipped)


def with_backend(config: TuneConfig, name: str, references_of: Sequence[str] = ()) -> TuneConfig:
    """``config`` on the runtime ``name``, ``references_of`` the runtimes whose one-liners are references too."""
    options = config.backend.options.model_copy(update={"reference_runtimes": list(references_of)})
    return config.model_copy(update={"backend": config.backend.model_copy(update={"name": name, "options": options})})


def choose_runtime(
    config: TuneConfig,
    measure: Callable[[TuneConfig, Sequence[str]], tuple[dict[str, dict[str, float]], dict[str, str]]] | None = None,
    say: Callable[[str], None] = lambda line: None,
    timed: bool = True,
) -> tuple[TuneConfig, RuntimeChoice | None]:
    """The config to run with: as it is where it names a runtime, else with the measured choice (``decide``).

    Args:
        config: The run's config.
        measure: Times the seeds of the runtimes named (``Timings``) and says which it could not time; default
            :func:`time_seeds`.
        say: Prints the choice's line.
        timed: False: ONNX Runtime without timing, for a command that only looks at the model (``inspect``).

    Returns:
        The config naming a runtime, and the choice (None where the config named one).
    """
    if config.backend.name != AUTO:
        return config, None
    runtimes, skipped = installed_runtimes()
    if not timed:
        runtimes, skipped = runtimes[:1], {"auto": "not timed for this command; autotune tune and evaluate time them"}
    speedups: dict[str, dict[str, float]] = {}
    if len(runtimes) > 1:
        timed, failed = (measure or time_seeds)(config, runtimes)
        speedups.update(timed)
        skipped.update(failed)
    choice = decide(speedups, skipped)
    say(choice.line)
    others = [runtime for runtime in speedups if runtime != choice.runtime]
    return with_backend(config, choice.runtime, others), choice


def time_seeds(config: TuneConfig, runtimes: Sequence[str]) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """Builds the FP32 and all-INT8 seeds on each runtime and times them side by side.

    ONNX Runtime's FP32 reference is the clock every speedup is over. Another runtime whose set-up or seeds fail
    is left out, with the reason (its runtime's own line, never a traceback).

    Raises:
        SetupError: ONNX Runtime cannot set the run up (the model, the data): the error the run would stop with.
    """
    from autotune.harness.prepare import SetupError

    engines: dict[tuple[str, str], Callable[[], object]] = {}
    skipped: dict[str, str] = {}
    reference = None
    for runtime in runtimes:
        try:
            seeds = _seed_runners(with_backend(config, runtime))
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
    protocol = Protocol(**{**CHOICE_PROTOCOL.to_dict(), "stop_at": time.time() + CHOICE_SECONDS})
    latencies = side_by_side([engines[key] for key in keys], reference, protocol)
    speedups: dict[str, dict[str, float]] = {CPU_RUNTIMES[0]: {"fp32": 1.0}}
    for (runtime, seed), latency in zip(keys, latencies, strict=True):
        speedups.setdefault(runtime, {})[seed] = round(latency.speedup, 4)
    return speedups, skipped


def _seed_runners(config: TuneConfig) -> dict[str, Callable[[], object]]:
    """Runs of each seed's engine over two calibration batches, by seed name, built as the run builds its seeds.

    The model, search space and calibration ranges are the run's (the calibration cached for it); the INT8 seed
    takes the ``max`` ranges, not the run's layerwise choices, which move scales, not kernels: the timing is the
    same, and a MiniLM's layerwise calibration alone takes minutes on two cores.

    Raises:
        SetupError: The model, the data or the backend cannot be used.
        BuildError: A seed does not build.
    """
    from autotune.backends import get_backend
    from autotune.data import load_dataset
    from autotune.harness.prepare import SetupError, calibrate_ranges, load_model, prepare_backend, search_space
    from autotune.quant.lowering import NONE, Quantization

    try:
        backend = get_backend(config.backend, config.model, config.accuracy_budget, config.metric.name)
        model = load_model(config.model, config.inputs, config.backend.name, config.cache_dir)
        space = search_space(config.search, model, backend)
        prepare_backend(backend, model, space)
        data = load_dataset(config.data.calibration, model.inputs, "calibration", config.seed + 2)
    except (ValueError, OSError) as error:
        raise SetupError(str(error)) from error
    workdir = config.cache_dir / "runtime_choice" / config.backend.name
    fp32 = space.uniform("fp32", backend.fp32_reference_knobs())
    artifacts = {"fp32": backend.build(fp32, NONE, workdir)}
    ranges = None
    for precision in SEEDS[1:]:
        plan: Plan = space.uniform(precision)
        if plan.hash == space.uniform("fp32").hash:  # no such layer here: the FP32 seed stands for it
            continue
        if ranges is None and ("int8" in precision or "fp8" in precision):
            ranges = Quantization(
                calibrate_ranges(config.calibration, config.cache_dir, model, backend, data).ranges("max")
            )
        artifacts[precision] = backend.build(plan, ranges if ranges is not None else NONE, workdir)
    batches = data.batches[:2]
    return {
        seed: (lambda artifact=artifact: [backend.run(artifact, batch) for batch in batches])
        for seed, artifact in artifacts.items()
    }
