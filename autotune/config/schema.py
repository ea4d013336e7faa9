"""The one typed config that the CLI and the Python API both take (its search sections: ``autotune.config.search``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from autotune.config.search import FinalistRule, PlannerConfig, PlanningRule, PPOConfig, RewardConfig, StrictSection
from autotune.model.optypes import TunableOp

Precision = Literal["fp32", "fp16", "bf16", "int8", "int8-dynamic", "fp8"]
KnobValue = str | int | float | bool
CALIBRATION_METHODS = ("layerwise", "max", "percentile", "entropy")


class ConfigError(ValueError):
    """The config is invalid; the message names each bad key and what is allowed."""


_Strict = StrictSection


class InputConfig(_Strict):
    """One model input at the shape it is tuned and deployed with."""

    name: str
    """The input's name in the graph."""
    shape: list[Annotated[int, Field(gt=0)]]
    """Its full shape, batch first; every batch of the data has it."""
    dtype: Literal["float32", "float16", "int64", "int32", "uint8", "int8", "bool"] = "float32"
    """Its element type; the data's arrays must have it."""


class ModelConfig(_Strict):
    """Where the model comes from: an ONNX file, or a PyTorch factory exported on first use."""

    onnx: Path | None = None
    """Path to an ONNX file (external data next to it is loaded)."""
    torch: str | None = None
    """A ``package.module:function`` returning a ``torch.nn.Module``; exported with ``torch.onnx.export`` and cached."""
    opset: int = Field(17, ge=13, le=23)
    """The ONNX opset a ``torch`` factory is exported at (an ONNX file keeps its own)."""
    include_activation_matmuls: bool = False
    """Also tune MatMuls whose both inputs are activations (attention's QK^T and AV)."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.onnx is None) == (self.torch is None):
            raise ValueError("give exactly one of model.onnx (a file) or model.torch ('module:function')")
        if self.torch is not None and ":" not in self.torch:
            raise ValueError(f"model.torch must look like 'package.module:function', got {self.torch!r}")
        return self


class DataSource(_Strict):
    """A set of batches: an ``.npz`` file (arrays named after the inputs, plus optional ``labels``) or a generator."""

    npz: Path | None = None
    """An ``.npz`` file: one array per model input, named after it, samples along the first axis (plus an optional
    ``labels`` array); cut into batches of the inputs' first dimension."""
    generator: str | None = None
    """``package.module:function(**kwargs)``: an iterable of ``{input name: array}`` batches (``labels``: labels)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the ``generator``."""
    random: Annotated[int, Field(gt=0)] | None = None
    """Number of random batches (latency-only runs and tests; fidelity metrics still work)."""
    limit: Annotated[int, Field(gt=0)] | None = None
    """Use at most this many batches."""
    start: int = Field(0, ge=0)
    """With ``npz``: the first sample (row of every array) this split reads, so one file can hold every split."""
    stop: Annotated[int, Field(gt=0)] | None = None
    """With ``npz``: one past the last sample this split reads; None: to the end of the file."""

    @model_validator(mode="after")
    def _one_source(self) -> DataSource:
        given = [name for name in ("npz", "generator", "random") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of npz, generator or random (got {given or 'none'})")
        if self.npz is None and (self.start or self.stop is not None):
            raise ValueError("start and stop select samples of an npz file; this source has none")
        if self.stop is not None and self.stop <= self.start:
            raise ValueError(f"stop ({self.stop}) must be greater than start ({self.start})")
        return self


class DataConfig(_Strict):
    """Calibration data, the evaluation data the search uses, and held-out data it never sees."""

    calibration: DataSource
    """What the calibration ranges are computed on."""
    evaluation: DataSource
    """What every plan's accuracy is measured on during the search."""
    holdout: DataSource | None = None
    """Used only to confirm the finalists before export; defaults to the evaluation data (not held out)."""


class MetricConfig(_Strict):
    """The accuracy metric; the accuracy drop is the reference's value minus the plan's, in the metric's units."""

    name: Literal["cosine", "top1_agreement", "snr", "top1", "custom"] = "cosine"
    """``cosine``: mean cosine similarity to the FP32 outputs; ``top1_agreement``: share of samples whose argmax
    matches FP32's; ``snr``: signal-to-noise ratio against FP32 in dB; ``top1``: accuracy against the data's labels;
    ``custom``: ``function``."""
    output: str | None = None
    """Model output to score; default the first."""
    function: str | None = None
    """For ``custom``: ``module:function(outputs, reference_outputs, labels) -> float``, higher is better."""
    early_stop_alpha: float | None = Field(0.01, gt=0, lt=1)
    """A search trial's scoring stops early when its drop is over the accuracy budget with confidence ``1 - alpha``
    (a sequential test over the evaluation batches, scored in a seeded shuffled order; ``alpha`` is the chance that
    a plan within the budget is stopped). Such a trial is over the budget for the search, and records its drop on
    the batches scored. Only on evaluation splits of 8 batches or more, for every metric but ``custom``; never for
    confirmations. None: every trial scores every batch."""

    @model_validator(mode="after")
    def _custom_needs_function(self) -> MetricConfig:
        if (self.name == "custom") != (self.function is not None):
            raise ValueError("metric.function ('module:function') is required for name: custom, and only for it")
        return self


class OnnxRuntimeOptions(_Strict):
    """``backend.options`` of ONNX Runtime and OpenVINO (their threads are ``backend.intra_op_threads``)."""

    reference_runtimes: list[Literal["onnxruntime", "openvino"]] = Field(default_factory=list)
    """Other CPU runtimes whose one-liners (but those that search) are references too, timed beside the finalists
    (``backend.name: auto`` names the runtime it did not choose)."""


TILING_LEVELS = ("NONE", "FAST", "MODERATE", "FULL")
"""TensorRT's ``TilingOptimizationLevel`` member names."""


def _unique(values: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(dict.fromkeys(values))


class TensorRTOptions(_Strict):
    """``backend.options`` of a TensorRT run; every ladder's first value is its knob's default.

    ``-1`` in ``max_num_tactics`` and ``max_aux_streams`` leaves the choice to TensorRT's heuristic.
    """

    workspace_ladder_mib: tuple[Annotated[int, Field(gt=0, strict=True)], ...] = Field((256, 1024, 4096), min_length=1)
    """Workspace memory-pool limits offered, in MiB."""
    builder_optimization_levels: tuple[Annotated[int, Field(ge=0, le=5, strict=True)], ...] = Field(
        (3, 4, 5), min_length=1
    )
    """``builder_optimization_level`` values offered (0-5; TensorRT's default is 3)."""
    max_num_tactics: tuple[Annotated[int, Field(ge=-1, strict=True)], ...] = Field((-1, 16), min_length=1)
    """``max_num_tactics`` values offered."""
    tiling_optimization_levels: tuple[Literal["NONE", "FAST", "MODERATE", "FULL"], ...] = Field(
        ("NONE", "MODERATE"), min_length=1
    )
    """``TilingOptimizationLevel`` member names offered."""
    max_aux_streams: tuple[Annotated[int, Field(ge=-1, strict=True)], ...] = Field((-1, 0), min_length=1)
    """``max_aux_streams`` values offered."""
    avg_timing_iterations: int = Field(4, ge=1, strict=True)
    """Timing runs averaged per tactic (API default 1, trtexec's 8)."""
    strict_precision: bool = Field(True, strict=True)
    """A requested precision that did not land fails the trial; False only logs a warning."""
    device: int = Field(0, ge=0, strict=True)
    """CUDA device index."""
    timing_cache: str | None = None
    """Timing-cache file; default ``<first workdir>/tensorrt-timing.cache``."""

    @field_validator(
        "workspace_ladder_mib", "builder_optimization_levels", "max_num_tactics", "max_aux_streams", mode="after"
    )
    @classmethod
    def _dedupe(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        return _unique(value)

    @field_validator("tiling_optimization_levels", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):
            return _unique(tuple(str(v).upper() for v in value))
        return value


class TorchOptions(_Strict):
    """``backend.options`` of the PyTorch backend."""

    device: str = Field("cuda", pattern=r"^(cpu|cuda(:\d+)?)$")
    """``cuda``, ``cuda:N``, or ``cpu`` (eager runs only: what the CPU test suite uses)."""
    quantized_gemm: Literal["autotune", "torchao"] = "autotune"
    """What INT8 and FP8 layers run: ``autotune``, this backend's static-scale wrappers (``torch._int_mm``,
    ``torch._scaled_mm``), or ``torchao``, torchao's ``Int8StaticActivationInt8WeightConfig`` and
    ``Float8StaticActivationFloat8WeightConfig`` per module (the ``torchao`` extra). Both take their activation
    scales from the run's calibration."""


BACKEND_OPTIONS: dict[str, type[_Strict]] = {
    "onnxruntime": OnnxRuntimeOptions,
    "openvino": OnnxRuntimeOptions,  # none either: threads are intra_op_threads, its CPU options free knobs
    "tensorrt": TensorRTOptions,
    "torch": TorchOptions,
}
"""The typed ``backend.options`` model of each backend."""

BackendOptions = OnnxRuntimeOptions | TensorRTOptions | TorchOptions


class BackendConfig(_Strict):
    """The backend that builds and measures engines, and its deployment settings (not searched)."""

    name: Literal["auto", "onnxruntime", "openvino", "tensorrt", "torch"] = "onnxruntime"
    """``onnxruntime`` (CPU, the default), ``openvino`` (CPU, its extra), ``tensorrt`` (NVIDIA GPUs), ``torch`` (a
    PyTorch module on a GPU), or ``auto``: the installed CPU runtime whose seeds run fastest here (timed first)."""
    intra_op_threads: int = Field(2, gt=0)
    """ONNX Runtime: threads per session; OpenVINO: ``INFERENCE_NUM_THREADS``. Fixed by the deployment."""
    timeout_s: float = Field(600.0, gt=0)
    """A build and measurement slower than this is a failed trial."""
    options: BackendOptions = Field(default_factory=OnnxRuntimeOptions)
    """The backend's own settings, validated by its model in ``BACKEND_OPTIONS`` (chosen by ``name``)."""

    @model_validator(mode="wrap")
    @classmethod
    def _typed_options(cls, data: Any, handler: Any) -> Any:
        """Validates ``options`` with the model of the named backend, so errors carry the full key path."""
        if isinstance(data, dict):
            name = data.get("name", "onnxruntime")
            options = data.get("options") or {}
            if isinstance(options, dict) and options.get("reference_runtimes", None) == []:  # the CPU default, dumped
                options = {key: value for key, value in options.items() if key != "reference_runtimes"}
            if name in BACKEND_OPTIONS and isinstance(options, dict):
                try:
                    typed = BACKEND_OPTIONS[name].model_validate(options)
                except ValidationError as error:
                    details = [
                        {
                            "type": item["type"],
                            "loc": ("options", *item["loc"]),
                            "input": item["input"],
                            **({"ctx": item["ctx"]} if "ctx" in item else {}),
                        }
                        for item in error.errors()
                    ]
                    raise ValidationError.from_exception_data(cls.__name__, details) from None
                data = {**data, "options": typed}
        return handler(data)


class SearchSpaceConfig(_Strict):
    """Restrictions of what the search may choose."""

    precisions: list[Precision] | None = None
    """Precisions offered to every layer (intersected with what the backend supports); default all it supports."""
    include_layers: str | None = None
    """Regex: tune only layers whose name matches; the rest stay FP32."""
    exclude_layers: str | None = None
    """Regex: keep matching layers in FP32."""
    op_types: list[TunableOp] | None = None
    """Op types whose layers are tuned; the others stay FP32. Default every tunable op type."""
    calibration_methods: list[Literal["layerwise", "max", "percentile", "entropy"]] = list(CALIBRATION_METHODS)
    """Values of the ``calibration`` knob, the first being its default: ``max``, ``percentile`` or ``entropy``
    ranges for every layer, or ``layerwise``: per layer, whichever of those three or of SmoothQuant at two strengths
    hurts the output least when that layer alone is INT8 (chosen once on the calibration data and cached; see
    ``autotune.quant.layerwise``)."""
    weight_granularity: list[Literal["per_channel", "per_tensor"]] = ["per_channel", "per_tensor"]
    """Values of the ``weight_granularity`` knob (INT8 weight scales per channel or per tensor), the first default."""
    knobs: dict[str, list[KnobValue]] = Field(default_factory=dict)
    """Restrict a backend knob to these values, e.g. ``graph_optimization_level: [all]``."""
    group_size: int = Field(1, gt=0)
    """Layers decided together in one step (graph order); >1 shortens episodes of large models."""
    budget_headroom: float = Field(0.0, ge=0, lt=1)
    """Fraction of the accuracy budget the search keeps free: it aims at ``(1 - headroom) x accuracy_budget`` on
    the evaluation data, so finalists still meet the full budget on held-out data, where drops run higher."""

    @field_validator("include_layers", "exclude_layers")
    @classmethod
    def _valid_regex(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as error:
                raise ValueError(f"not a valid regular expression: {error}") from error
        return value

    @field_validator("calibration_methods", "weight_granularity")
    @classmethod
    def _non_empty(cls, value: list) -> list:
        if not value:
            raise ValueError("must list at least one value")
        return value


class CalibrationConfig(_Strict):
    """Settings of our calibration (TensorRT 11 has none)."""

    percentile: float = Field(99.99, gt=0, le=100)
    """The percentile of absolute activation values the ``percentile`` method takes as the range."""
    num_bins: int = Field(2048, ge=128)
    """Histogram bins of each activation, for the ``percentile`` and ``entropy`` methods."""


class MeasureConfig(_Strict):
    """The latency protocol: the candidate and the FP32 reference alternate, rounds x repeats each."""

    warmup: int = Field(2, ge=1)
    """Untimed runs after every switch between sessions (the first run after a switch is the slowest)."""
    repeats: int = Field(5, ge=1)
    """Timed runs of each session per round."""
    rounds: int = Field(4, ge=1)
    """Quiet rounds per measurement: the speedup is the median of their ratios (``autotune.measure.timing``)."""
    quiet_band: float | None = Field(0.05, gt=0)
    """A round counts when its FP32 reference ran within this fraction of the fastest reference round the trial
    process, or an earlier one on this machine, has timed (in a slow spell of the machine INT8 slows more than FP32,
    so the ratio itself moves), and no plan in it ran more than 25 % above its own lower quartile of rounds (a spell
    that slowed one plan alone). None: no pace is checked."""
    settle_s: float = Field(5.0, ge=0)
    """Seconds the trial process times before it trusts its fastest reference round as the machine's quiet pace;
    the first measurement of a process (``autotune evaluate``'s only one) lasts at least this long. Earlier processes'
    pace on this machine (``cache_dir``/reference_pace.json) counts too: a spell is not taken for the pace."""
    max_rounds: int | None = Field(None, ge=1)
    """Rounds after which a measurement backs off (``busy_patience_s``) or stops although fewer than ``rounds``
    were quiet. None: four times ``rounds``."""
    busy_wait: float | None = Field(0.1, gt=0, le=1)
    """A round counts only when the trial process's threads waited for a core (the scheduler's run-queue wait) at
    most this fraction of its wall time: another busy process on the cores slows plans unequally, so such rounds
    are timed again. None: the wait is not checked (``autotune.measure.interference``)."""
    min_sample_ms: float = Field(1.0, ge=0)
    """A timed sample lasts at least this long: a plan that runs faster runs several times back to back per
    sample (the count set from one run, as ``timeit`` autoranges) and the sample is their mean, so a
    sub-millisecond model is timed over more than the timer's and the scheduler's jitter. 0: one run a sample."""
    busy_others: float | None = Field(0.1, gt=0, le=1)
    """Rounds count only while other processes took at most this share of the cores the trial process may use
    (``/proc/stat``, steal included, read over spans of at least 0.5 s, so a shorter measurement times on until
    one can be read). Beside another busy process, even at ``nice 19``, the timed threads hardly waited for a core
    while all-INT8 slowed more than FP32: such spans are timed again, and a measurement that finds none other says
    the machine was too busy. None: not checked."""
    busy_patience_s: float = Field(5.0, ge=0)
    """Seconds a measurement that found no quiet rounds while another process held the cores may spend past its
    round limit, waiting off the cores (random back-offs of up to 2 s) and timing more rounds after each, before it
    times each plan by its own fastest runs and says the machine was too busy. Without such a process it does not
    wait, unless the machine itself ran slow (``spell_patience_s``)."""
    spell_patience_s: float = Field(15.0, ge=0)
    """As ``busy_patience_s``, for a measurement whose FP32 reference has not yet run at the pace earlier processes
    timed it at on this machine while no other process got in the way: a slow spell of the machine itself (a VM's
    host slowed FP32, and all-INT8 more, for seconds at a time). After it, each plan is timed by its fastest
    runs and the measurement says the machine ran slow."""
    turn_s: float = Field(0.6, ge=0)
    """Seconds a plan's turn in a round (warm-up and timed runs) lasts at most: a slower plan gets one warm-up and
    the timed runs that fit, at least two (docs/measurement.md#quiet-rounds). 0: ``warmup`` and ``repeats``."""


class BudgetConfig(_Strict):
    """How much a run may spend."""

    builds: int = Field(150, gt=0)
    """Trials that build and measure; trials answered from the store are free."""
    stall_episodes: int = Field(400, gt=0)
    """Stop early when this many plans in a row were all answered from the store (the search converged)."""
    minutes: float | None = Field(None, gt=0)
    """Wall-clock minutes one session (``tune`` or ``resume``) may take, set-up, search, confirmation and export
    together, whatever ``builds`` has left. The search starts no build that would leave too little time for the
    confirmation its trials so far say it needs; the confirmation is cut to the time left (fewer finalists, then
    one-liners, then rounds, said in one line), and with none left FP32 is exported and the run says why. The
    set-up (model analysis, calibration) is not cut: a run whose set-up took the time searches nothing.
    ``summary.json`` says where the time went (``time_s``). None: builds alone bound the run."""


class ConfirmConfig(_Strict):
    """Re-measurement of the finalists before export: many short rounds, each compared within itself."""

    top_k: int = Field(5, gt=0)
    """Finalists confirmed: the best plans of the search (``autotune.search.select``)."""
    repeats: int = Field(10, ge=1)
    """Timed runs of each finalist, one-liner and FP32 per round."""
    rounds: int = Field(8, ge=1)
    """Rounds of the confirmation, each timing FP32, every finalist and the one-liners in turn."""
    self_check: bool = True
    """Time FP32 against itself before the search and read the confirmation's FP32 row the same way
    (``autotune.measure.selfcheck``): outside [0.97, 1.03] the run says so, confirms in more rounds, and ratios
    within the measured noise are ties. Off: neither check; ties only between equal speedups."""
    references: list[str] | None = None
    """The backend's one-liners (``ort-static``, ``ort-dynamic`` for ONNX Runtime) measured beside the finalists,
    with this protocol; default every one the backend offers, ``[]`` for none."""


class ExecutionConfig(_Strict):
    """Where trials run: one trial process on this machine (default), N of them side by side, or a Ray cluster.

    The run itself (store, search, agent, confirmation) stays in the driver; workers only build and measure. A
    CPU worker on this machine is pinned to its own ``backend.intra_op_threads`` cores; a GPU worker gets its own
    device. Confirmation and export run on one worker, with the others idle, as in a run of one worker.
    """

    workers: int = Field(1, ge=1)
    """Trial workers that build and measure at once; 1 runs every trial in one child process, as always."""
    backend: Literal["local", "ray"] = "local"
    """``local``: child processes of the run; ``ray``: Ray Core actors on a Ray cluster (the ``ray`` extra)."""
    ray_address: str | None = None
    """The cluster ``ray.init(address=...)`` joins (``auto``, ``ray://head:10001``); None starts a local one."""
    gpus_per_worker: int = Field(0, ge=0, le=1)
    """1: each worker gets one GPU (``CUDA_VISIBLE_DEVICES`` locally, ``num_gpus=1`` on Ray); 0: CPU workers."""
    pin_cores: bool | None = None
    """Pin each local CPU worker to its own ``backend.intra_op_threads`` cores; None pins when ``workers > 1``."""

    @model_validator(mode="after")
    def _ray_address_needs_ray(self) -> ExecutionConfig:
        if self.ray_address is not None and self.backend != "ray":
            raise ValueError("ray_address is only used with backend: ray")
        return self


_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class TuneConfig(_Strict):
    """Everything a tuning run needs; the resolved copy is saved as ``runs/<name>/config.yaml``."""

    name: str
    """Run name: the run directory is ``<runs_dir>/<name>``."""
    seed: int = 0
    """Seed of the search, the policy and random data."""
    model: ModelConfig
    inputs: list[InputConfig] = Field(default_factory=list)
    """Input shapes and dtypes; required for inputs with dynamic dimensions."""
    data: DataConfig
    metric: MetricConfig = MetricConfig()
    backend: BackendConfig = BackendConfig()
    search: SearchSpaceConfig = SearchSpaceConfig()
    calibration: CalibrationConfig = CalibrationConfig()
    measure: MeasureConfig = MeasureConfig()
    reward: RewardConfig = RewardConfig()
    accuracy_budget: float = Field(0.01, ge=0)
    """Largest accuracy drop allowed, in the metric's units."""
    budget: BudgetConfig = BudgetConfig()
    planner: PlannerConfig = PlannerConfig()
    ppo: PPOConfig = PPOConfig()
    confirm: ConfirmConfig = ConfirmConfig()
    execution: ExecutionConfig = ExecutionConfig()
    runs_dir: Path = Path("runs")
    """Folder of the run directories (relative to the working directory)."""
    cache_dir: Path = Path(".cache/autotune")
    """Exported models and calibration statistics, shared by runs."""
    from_runs: list[Path] = Field(default_factory=list)
    """Earlier run directories whose trials a new run reuses (``autotune tune --from RUN_DIR``): those measured on
    the same model, data, backend and machine enter its store as imported trials that cost no build."""

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        if not _RUN_NAME.match(value) or ".." in value:
            raise ValueError(
                "must be letters, digits, '_', '-' or '.', with no path separator and no '..' "
                "(the run directory is runs/<name>)"
            )
        return value

    @property
    def search_budget(self) -> float:
        """The accuracy budget the search aims at: the budget less the headroom kept for held-out data."""
        return self.accuracy_budget * (1.0 - self.search.budget_headroom)

    @property
    def bold_budget(self) -> float:
        """The drop the bold plans aim at: ``planner.bold_plan`` of the way from the search budget to the budget."""
        return self.search_budget + self.planner.bold_plan * (self.accuracy_budget - self.search_budget)

    @property
    def finalists(self) -> FinalistRule:
        """The budgets, reward and places that order the measured plans for confirmation."""
        return FinalistRule(
            self.accuracy_budget, self.search_budget, self.reward, self.confirm.top_k, self.planner.bold_places
        )

    @property
    def planning(self) -> PlanningRule:
        """The planner's settings, seed, budgets and build budget."""
        return PlanningRule(self.planner, self.seed, self.search_budget, self.bold_budget, self.budget.builds)

    @property
    def run_dir(self) -> Path:
        """``<runs_dir>/<name>``."""
        return self.runs_dir / self.name

    def with_absolute_paths(self) -> TuneConfig:
        """``runs_dir`` and ``cache_dir`` made absolute: a resume or a worker in another folder finds the same ones."""
        return self.model_copy(update={"runs_dir": self.runs_dir.resolve(), "cache_dir": self.cache_dir.resolve()})


def _format_errors(error: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown key (check the spelling; see configs/ for examples)"
        elif item["type"] == "literal_error":
            message = f"{message}; got {item.get('input')!r}"
        lines.append(f"  {location}: {message}")
    return "\n".join(lines)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Applies ``key.sub=value`` overrides (values parsed as YAML) to a raw config dict.

    Raises:
        ConfigError: An override is not ``key=value``.
    """
    for override in overrides:
        if "=" not in override:
            raise ConfigError(f"override {override!r} must look like key.subkey=value")
        key, raw = override.split("=", 1)
        target = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"override {override!r}: {part!r} is not a section")
        target[parts[-1]] = yaml.safe_load(raw)
    return data


def _resolve_paths(data: dict[str, Any], base: Path) -> None:
    """Makes relative file paths in the config relative to the config file's folder, and absolute.

    Absolute, so that the resolved copy saved in a run directory still points at the same files.
    """

    def fix(section: dict[str, Any] | None, key: str) -> None:
        if isinstance(section, dict) and isinstance(section.get(key), str) and not Path(section[key]).is_absolute():
            section[key] = str((base / section[key]).resolve())

    fix(data.get("model"), "onnx")
    for split in ("calibration", "evaluation", "holdout"):
        fix((data.get("data") or {}).get(split), "npz")


_PLANNER_KEYS = ("probe_plans", "build_model_plan", "model_plans", "bold_plan", "imitation", "priors", "prior_weight")
MOVED_KEYS: dict[tuple[str, str], str] = {
    **{("ppo", key): f"planner.{key}" for key in _PLANNER_KEYS},
    ("confirm", "bold_places"): "planner.bold_places",
}
"""Keys that moved to another section, old (section, key) to the new dotted key: an old config gets one line."""


def _check_moved_keys(data: dict[str, Any], source: str) -> None:
    moved = [
        f"{section}.{key} is now {new}"
        for (section, key), new in MOVED_KEYS.items()
        if isinstance(data.get(section), dict) and key in data[section]
    ]
    if moved:
        raise ConfigError(f"invalid config {source}: {'; '.join(moved)} (the surrogate planner has its own section)")


def parse_config(data: Any, source: str = "<dict>") -> TuneConfig:
    """Validates a raw config mapping.

    Raises:
        ConfigError: With every bad key path and what is allowed.
    """
    if not isinstance(data, dict):
        raise ConfigError(
            f"invalid config {source}: the top level must be a mapping of keys, got {type(data).__name__}"
        )
    _check_moved_keys(data, source)
    try:
        return TuneConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_errors(error, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> TuneConfig:
    """Loads a YAML config with a safe loader, applies overrides and validates it.

    Args:
        path: The YAML file.
        overrides: ``key.sub=value`` strings, as given to the CLI's ``--set``.

    Returns:
        The resolved config.

    Raises:
        ConfigError: The file is missing, not YAML, or invalid.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None
    if isinstance(data, dict):
        data = apply_overrides(data, overrides or [])
        _resolve_paths(data, path.parent)
    return parse_config(data, str(path))


def dump_config(config: TuneConfig) -> str:
    """The resolved config as YAML."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
