"""The one typed config that the CLI and the Python API both take."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from autotune.optypes import TunableOp

Precision = Literal["fp32", "fp16", "bf16", "int8", "fp8"]
KnobValue = str | int | float | bool
CALIBRATION_METHODS = ("layerwise", "max", "percentile", "entropy")
WEIGHT_GRANULARITIES = ("per_channel", "per_tensor")


class ConfigError(ValueError):
    """The config is invalid; the message names each bad key and what is allowed."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputConfig(_Strict):
    """One model input at the shape it is tuned and deployed with."""

    name: str
    shape: list[Annotated[int, Field(gt=0)]]
    dtype: Literal["float32", "float16", "int64", "int32", "uint8", "int8", "bool"] = "float32"


class ModelConfig(_Strict):
    """Where the model comes from: an ONNX file, or a PyTorch factory exported on first use."""

    onnx: Path | None = None
    """Path to an ONNX file (external data next to it is loaded)."""
    torch: str | None = None
    """A ``package.module:function`` returning a ``torch.nn.Module``; exported with ``torch.onnx.export`` and cached."""
    opset: int = Field(17, ge=13, le=23)
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
    generator: str | None = None
    """``package.module:function(**kwargs)`` returning an iterable of ``{input name: array}`` batches
    (a ``labels`` key holds labels)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    random: Annotated[int, Field(gt=0)] | None = None
    """Number of random batches (latency-only runs and tests; fidelity metrics still work)."""
    limit: Annotated[int, Field(gt=0)] | None = None
    """Use at most this many batches."""

    @model_validator(mode="after")
    def _one_source(self) -> DataSource:
        given = [name for name in ("npz", "generator", "random") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of npz, generator or random (got {given or 'none'})")
        return self


class DataConfig(_Strict):
    """Calibration data, the evaluation data the search uses, and held-out data it never sees."""

    calibration: DataSource
    evaluation: DataSource
    holdout: DataSource | None = None
    """Used only to confirm the finalists before export; defaults to the evaluation data (not held out)."""


class MetricConfig(_Strict):
    """The accuracy metric; the accuracy drop is the reference's value minus the plan's, in the metric's units."""

    name: Literal["cosine", "top1_agreement", "snr", "top1", "custom"] = "cosine"
    output: str | None = None
    """Model output to score; default the first."""
    function: str | None = None
    """For ``custom``: ``module:function(outputs, reference_outputs, labels) -> float``, higher is better."""

    @model_validator(mode="after")
    def _custom_needs_function(self) -> MetricConfig:
        if (self.name == "custom") != (self.function is not None):
            raise ValueError("metric.function ('module:function') is required for name: custom, and only for it")
        return self


class OnnxRuntimeOptions(_Strict):
    """``backend.options`` of ONNX Runtime: none yet (its threads are ``backend.intra_op_threads``)."""


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

    name: Literal["onnxruntime", "openvino", "tensorrt", "torch"] = "onnxruntime"
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
    calibration_methods: list[Literal["layerwise", "max", "percentile", "entropy"]] = list(CALIBRATION_METHODS)
    """Values of the ``calibration`` knob, the first being its default: ``max``, ``percentile`` or ``entropy``
    ranges for every layer, or ``layerwise``: per layer, whichever of those three or of SmoothQuant at two strengths
    hurts the output least when that layer alone is INT8 (chosen once on the calibration data and cached; see
    ``autotune.quant.layerwise``)."""
    weight_granularity: list[Literal["per_channel", "per_tensor"]] = ["per_channel", "per_tensor"]
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
    num_bins: int = Field(2048, ge=128)


class MeasureConfig(_Strict):
    """The latency protocol: the candidate and the FP32 reference alternate, rounds x repeats each."""

    warmup: int = Field(2, ge=1)
    """Untimed runs after every switch between sessions (the first run after a switch is 1.5x slower)."""
    repeats: int = Field(5, ge=1)
    rounds: int = Field(4, ge=1)
    """Quiet rounds per measurement: the speedup is the median of their ratios (``autotune.measure``)."""
    quiet_band: float | None = Field(0.05, gt=0)
    """A round counts when its FP32 reference ran within this fraction of the fastest reference round the trial
    process has timed: in a slow spell of the machine (another tenant on the host's cores) INT8 slows more than
    FP32, so the ratio itself moves. None: every round counts."""
    settle_s: float = Field(5.0, ge=0)
    """Seconds the trial process times before it trusts its fastest reference round as the machine's quiet pace;
    the first measurement of a process (``autotune evaluate``'s only one) lasts at least this long."""
    max_rounds: int | None = Field(None, ge=1)
    """Rounds after which a measurement stops although fewer than ``rounds`` were quiet (then the rounds of the
    fastest reference count). None: four times ``rounds``."""


class RewardConfig(_Strict):
    """``log(t_ref / t_plan) - accuracy_penalty * excess``, where excess is ``max(0, drop - accuracy_budget)``.

    With ``penalty_units: budget`` (default) the excess is measured in budgets (``excess / accuracy_budget``), so
    one penalty weight works for any metric scale: with the default 5, a plan 10% over the budget loses 0.5, as
    much as a 1.65x speedup gains. With ``metric`` the excess is in the metric's own units. Failures get ``failure``.
    """

    accuracy_penalty: float = Field(5.0, ge=0)
    penalty_units: Literal["budget", "metric"] = "budget"
    failure: float = -1.0
    tie_within: float | None = Field(None, ge=0)
    """Relative speedup differences the reward treats as ties (``autotune.search.reward.latency_gain``); None: the
    noise of the run's own FP32 self-check (``autotune.measure.SelfCheck``), 0: none."""


class BudgetConfig(_Strict):
    """How much a run may spend."""

    builds: int = Field(150, gt=0)
    """Trials that build and measure; trials answered from the store are free."""
    stall_episodes: int = Field(400, gt=0)
    """Stop early when this many plans in a row were all answered from the store (the search converged)."""
    minutes: float | None = Field(None, gt=0)
    """Wall-clock minutes the search may build for in one session (``tune`` or ``resume``), whatever ``builds``
    has left: a build started in time finishes, then the run goes on to the confirmation. Set-up and the
    confirmation come on top. None: builds alone bound the search."""


class PPOConfig(_Strict):
    """MaskablePPO hyperparameters, sized for steps that cost seconds: an update every few builds."""

    episodes_per_update: int = Field(8, gt=0)
    """Episodes (plans) collected per policy update; n_steps = this x the episode length."""
    minibatches: int = Field(4, gt=0)
    n_epochs: int = Field(10, gt=0)
    learning_rate: float = Field(3e-4, gt=0)
    gamma: float = Field(1.0, gt=0, le=1)
    gae_lambda: float = Field(0.95, gt=0, le=1)
    ent_coef: float = Field(0.01, ge=0)
    clip_range: float = Field(0.2, gt=0)
    net_arch: list[Annotated[int, Field(gt=0)]] = [64, 64]
    checkpoint_every_builds: int = Field(25, gt=0)
    imagined_episodes: int = Field(128, ge=0)
    """Episodes rehearsed on the additive model of the trials so far after every real update (Dyna-style);
    they cost no build. 0: learn from real builds only."""
    compute_share: float = Field(1.0, ge=0)
    """The agent's own compute (rehearsals, planning, policy updates) may take at most this many times the wall
    time its builds took so far: each rehearsal gets the episodes that fit (up to ``imagined_episodes``), so a model
    that builds in a second tunes in minutes and one that builds in ten gets the full rehearsals. 0: no limit."""
    reward_shaping: bool = True
    """Pay each layer step the change in the reward its per-layer estimates predict (potential-based shaping:
    the episode's return is unchanged); False: one sparse reward at the end of the episode."""


class PlannerConfig(_Strict):
    """The surrogate planner: the plans the additive model of the trials proposes, its priors, the bold places.

    Its plans are the opening, the probes, the model's best plans and the bold plans; it is a peer of the PPO policy
    (``ppo``), which holds only the policy's hyperparameters.
    """

    probe_plans: bool = True
    """Build an orthogonal design of plans first (every layer quantized in half of them; at most a third of the
    build budget), so the additive model tells every layer's saving and drop apart from the start."""
    build_model_plan: bool = True
    """After every rehearsal, also build the plan the additive model of the trials rates fastest within the search
    budget (a local search on the model; Dyna's planning step), outside PPO's rollouts."""
    model_plans: int = Field(1, gt=0)
    """Distinct plans of the model (its best unmeasured ones) built at each planning step, per worker."""
    bold_plan: float = Field(0.6, ge=0, le=1)
    """Each planning step also builds the model's best unmeasured plan whose drop is this fraction of the way from
    the search budget to the accuracy budget: where a finalist's bold place (``bold_places``) is, and
    where held-out data decides whether a plan meets the budget. 0 (or no ``search.budget_headroom``): off."""
    imitation: float = Field(0.9, ge=0, lt=1)
    """Before its first rehearsal, the policy learns to choose the model's best plan with this mean probability per
    step (behaviour cloning), so PPO's first real plans vary that plan instead of following a fresh policy, which
    the penalty of over-budget plans drives toward FP32; 0: off (``autotune/agent.py``, ``imitate``)."""
    priors: bool = True
    """Start the additive model from per-layer priors known before any build (single-layer output errors of the
    layerwise calibration, FP32 runtime shares; ``autotune/search/prior.py``): the model's first plan is built
    right after all-INT8, and probe plans vary only the layers whose prior leaves the choice open (at most a
    sixth of the build budget). Without layerwise calibration only the savings have a prior."""
    prior_weight: float = Field(2.0, gt=0)
    """How many trials' worth a layer's prior counts in the additive fit (its ridge weight toward the prior)."""
    bold_places: int = Field(2, ge=0)
    """Of the ``confirm.top_k`` finalist places, up to this many go to the fastest plans between the search budget and
    the accuracy budget, where each is faster than every plan within the search budget (``autotune.search.select``)."""


class ConfirmConfig(_Strict):
    """Re-measurement of the finalists before export: many short rounds, each compared within itself."""

    top_k: int = Field(5, gt=0)
    repeats: int = Field(10, ge=1)
    rounds: int = Field(8, ge=1)
    self_check: bool = True
    """Time FP32 against itself before the search and read the confirmation's FP32 row the same way
    (``autotune.harness.selfcheck``): outside [0.97, 1.03] the run says so, confirms in more rounds, and ratios
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
    def run_dir(self) -> Path:
        """``<runs_dir>/<name>``."""
        return self.runs_dir / self.name


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


MOVED_KEYS: dict[tuple[str, str], str] = {
    **{
        ("ppo", key): f"planner.{key}"
        for key in (
            "probe_plans",
            "build_model_plan",
            "model_plans",
            "bold_plan",
            "imitation",
            "priors",
            "prior_weight",
        )
    },
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
