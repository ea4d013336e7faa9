"""A tuning run from start to export: search, confirm the finalists on held-out data, export the winner."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.api import analyze, check_data, choose_runtime, references
from autotune.backends import searching_references
from autotune.config.schema import ConfigError, TuneConfig, dump_config
from autotune.config.views import SearchSettings
from autotune.confirm import confirm_finalists, export_ranked, one_liner_plans
from autotune.data import Splits
from autotune.harness import Evaluator
from autotune.harness.deadline import RunDeadline, TrialCosts
from autotune.harness.earlier_runs import import_runs
from autotune.harness.identity import (
    KEY_META,
    check_comparable,
    check_resumable,
    comparability_key,
    data_fingerprint,
)
from autotune.harness.prepare import Stages
from autotune.harness.priors import prior_inputs, store_prior_inputs
from autotune.harness.process import ChildRunner
from autotune.harness.runner import confirmation_protocol
from autotune.harness.runtime_choice import RuntimeChoice
from autotune.measure.selfcheck import (
    bar_line,
    bar_order,
    check_search_timing,
    confirmation_rounds,
    measured_bar,
    say,
    with_measured_noise,
)
from autotune.model.layers import LoadedModel
from autotune.monitor import RunMonitor
from autotune.plan import PRECISIONS, KnobValue, Plan
from autotune.run.directory import RunDir
from autotune.run.files import write_json
from autotune.run.meta import RunMeta
from autotune.run.store import TrialStore
from autotune.run.trial import TrialResult
from autotune.search.agent import AgentPaths, TrialModels
from autotune.search.driver import Driver
from autotune.search.estimate import RefittedEstimates
from autotune.search.registry import STRATEGIES, SearchInputs, run_strategy
from autotune.search.space import SearchSpace


class _Bookkeeping:
    """The driver's callback that keeps the run's books as each result lands.

    A store hit is counted in the run's meta; then ``landed`` moves the search's deadline to leave the confirmation
    its time.
    """

    def __init__(self, store: TrialStore, landed: Callable[[], None]):
        self.store = store
        self.landed = landed

    def on_result(self, result: TrialResult, driver: Driver) -> None:
        """Counts a store hit, then calls ``landed``."""
        if result.from_store:
            RunMeta.count_cache_hit(self.store)
        self.landed()


def search(
    config: TuneConfig,
    space: SearchSpace,
    driver: Driver,
    evaluator: Evaluator,
    run: RunDir,
    strategy: str,
    resume: bool,
) -> dict[str, KnobValue]:
    """Runs one strategy through the driver, after the uniform seeds, until the build budget is spent.

    Returns:
        The free knobs the seeds fixed, name to value.

    Raises:
        ConfigError: The strategy is unknown.
    """
    from envs.engine_build import EngineBuildEnv  # the agent's env: gymnasium loads only for a search that runs

    paths = None if run is None else AgentPaths(run.tensorboard, run.checkpoints, resume)
    models = lambda seeded: _trial_models(config, seeded, evaluator)  # noqa: E731
    inputs = SearchInputs(SearchSettings.of(config), driver.workers, models, paths, make_env=EngineBuildEnv)
    return run_strategy(strategy, driver, space, inputs)


def _trial_models(config: TuneConfig, space: SearchSpace, evaluator: Evaluator) -> TrialModels:
    """The models of the store's trials for the agent and the planner, from per-layer priors with ``planner.priors``."""
    inputs = prior_inputs(config.metric.name, space, evaluator) if config.planner.priors else None
    if inputs is not None:
        store_prior_inputs(evaluator.store, inputs)
    fitted = RefittedEstimates(
        lambda: list(evaluator.store.trials()),
        space.layer_names,
        {knob.name: knob.default for knob in space.knobs},
        count=lambda: len(evaluator.store),
        prior_inputs=inputs,
        prior_weight=config.planner.prior_weight,
    )
    return TrialModels.refitted(fitted, inputs is not None)


def tune(
    config: TuneConfig | None = None,
    *,
    resume_dir: Path | None = None,
    strategy: str = "ppo",
    isolate: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """A whole tuning run, or the rest of an interrupted one.

    Args:
        config: The run's config (not needed with ``resume_dir``).
        resume_dir: A run directory to continue; its trials are reused, none is measured twice.
        strategy: One of ``STRATEGIES``: ``ppo`` (the agent), a search, or a precision (one uniform plan).
        isolate: Run trials in a child process.
        progress: Show a progress bar.

    Returns:
        The summary written to ``summary.json``.
    """
    if resume_dir is not None:
        run, config = RunDir.open(resume_dir)
    elif config is None:
        raise ConfigError("tune() needs a config, or resume_dir to continue a run")
    else:  # refused before the runtime choice and the set-up time anything (MiniLM's: a minute and a half)
        RunDir.new(config.run_dir)
    deadline = RunDeadline(config.budget.minutes, time.time())
    stage = Stages()
    splits = Splits(config.data, config.seed)  # the set-up's data: each split loaded once, then handed on
    with stage("backend_choice"):  # backend.name: auto; the resolved config names the runtime, so a resume keeps it
        config, choice = choose_runtime(config, say=say, splits=splits)
    trial_process = _start_early(config, isolate)  # loads the backend while this process analyses
    try:
        model, space, key = _set_up(config, trial_process, stage, strategy, splits)
        del splits  # the trial process loads its own: this one keeps no data through the run
        if resume_dir is None:
            check_comparable(config.from_runs, key)
            run = RunDir.create(config.run_dir, dump_config(config.with_absolute_paths()))
        with TrialStore(run.store) as store:
            strategy = _open_run(store, config, key, resume_dir, strategy, choice)
            monitor = RunMonitor(
                config.reward, config.search_budget, run.tensorboard, config.budget.builds, store.builds(), progress
            )
            monitor.seed(list(store.trials()))
            try:
                with stage("trial_process"):
                    evaluator = Evaluator(config, store, isolate=isolate, started=trial_process)
                with evaluator:
                    stage.seconds.update({f"trial_process.{k}": v for k, v in evaluator.setup_stages_s.items()})
                    session = _Session(run, config, evaluator, monitor, stage, deadline)
                    summary = _search_and_confirm(session, space, strategy, resume_dir is not None)
            finally:
                monitor.close()
    finally:
        if trial_process is not None:
            trial_process.stop()  # the evaluator stopped it already, unless the run ended before one took it
    write_json(run.summary, summary)
    return summary


def _open_run(
    store: TrialStore,
    config: TuneConfig,
    key: dict,
    resume_dir: Path | None,
    strategy: str,
    choice: RuntimeChoice | None,
) -> str:
    """Checks a resumed run's store against this machine, or records a new run's key and runtime choice."""
    if resume_dir is not None:
        check_resumable(store, key, resume_dir)  # another machine or runtime: refused in one line
        return RunMeta.read(store).strategy or strategy
    store.set_meta(KEY_META, key)
    RunMeta.write(store, strategy=strategy, imported_from=import_runs(store, config.from_runs, key))
    if choice is not None:
        RunMeta.write(store, backend_choice=choice.to_dict())
    return strategy


def _start_early(config: TuneConfig, isolate: bool) -> ChildRunner | None:
    """The trial process the run's ``Evaluator`` will take over, launched now, gated; None where it starts none."""
    if not Evaluator.one_trial_process(config.execution, isolate):
        return None
    child = ChildRunner(config)
    child.launch(gated=True)
    return child


def _set_up(
    config: TuneConfig, trial_process: ChildRunner | None, stage: Stages, strategy: str, splits: Splits
) -> tuple[LoadedModel, SearchSpace, dict[str, Any]]:
    """The model analysed, the data and the request checked, and the run's comparability key.

    All before the run directory exists: a run that cannot start leaves nothing behind that a resume would trust.
    The profile, the data check and the key's fingerprint read the same ``splits``, each split loaded once.
    """
    model, space = _analyze(config, trial_process, stage, splits)
    with stage("check_data"):
        check_data(config, model, splits)
        _check_request(config, space, strategy)
    data = data_fingerprint(splits, model.inputs)
    key = comparability_key(model.hash, data, config.metric, config.calibration, config.backend, config.measure)
    return model, space, key


def _analyze(
    config: TuneConfig, trial_process: ChildRunner | None, stage: Stages, splits: Splits
) -> tuple[LoadedModel, SearchSpace]:
    """``analyze`` as stage ``analyze``; the trial process reads the model once ``analyze`` hands it on."""
    started = time.perf_counter()

    def model_ready() -> None:
        stage.seconds["analyze.model"] = time.perf_counter() - started
        if trial_process is not None:
            trial_process.release()

    with stage("analyze"):
        return analyze(config, model_ready=model_ready, splits=splits)


def _check_request(config: TuneConfig, space: SearchSpace, strategy: str) -> None:
    """Refuses, in one line, a strategy or a one-liner the run cannot have."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; strategies: {', '.join(STRATEGIES)}")
    if strategy in PRECISIONS and strategy != "fp32" and space.uniform(strategy) == space.uniform("fp32"):
        raise ConfigError(f"strategy {strategy}: the {config.backend.name} backend offers no {strategy} layer here")
    if config.confirm.references:
        offered = references(config)
        unknown = sorted(set(config.confirm.references) - set(offered))
        if unknown:
            raise ConfigError(
                f"confirm.references: {unknown} not offered by the {config.backend.name} backend; "
                f"it offers {list(offered)}"
            )


@dataclass(frozen=True)
class _Session:
    """What one session of a run works with, from the trial process's start to the export."""

    run: RunDir
    config: TuneConfig
    evaluator: Evaluator
    monitor: RunMonitor
    stage: Stages
    deadline: RunDeadline

    @property
    def store(self) -> TrialStore:
        """The run's store."""
        return self.evaluator.store


def _search_and_confirm(session: _Session, space: SearchSpace, strategy: str, resumed: bool) -> dict[str, Any]:
    """The search through the driver (its wall time kept, even on Ctrl-C), then the confirmation and the export.

    ``session.stage`` holds the set-up's stages so far; the timing self-check is the last, then the set-up is
    recorded. The search, the confirmation and the export share what ``session.deadline`` leaves
    (``autotune.harness.deadline``).
    """
    config, evaluator, store, deadline = session.config, session.evaluator, session.store, session.deadline
    wall_before = RunMeta.read(store).wall_s
    fp32 = evaluator.fp32_plan()  # the reference's own plan: the self-checks time the reference against itself
    one_liners = one_liner_plans(evaluator, space.layer_names)
    # Timed first where the run's time is not bounded: with budget.minutes the set-up is the search's time, and a
    # 200 ms model's one-liners took 213 s of a 5-minute run; a search of their own is timed in the confirmation.
    slow = searching_references(config.backend.name)
    first = [p for p in one_liners if p.reference not in slow] if config.budget.minutes is None else []
    with session.stage("timing_self_check"):
        search_check = check_search_timing(evaluator, store, fp32, first)
    bar = measured_bar(store)
    one_liners = bar_order(one_liners, bar, config.accuracy_budget)
    if not resumed and (line := bar_line(bar, config.accuracy_budget)):
        say(line)
    setup_s = deadline.clock() - deadline.started
    RunMeta.write(store, setup_s=setup_s, setup_stages_s=dict(session.stage.seconds))
    rounds = confirmation_rounds(config.confirm, search_check) or config.confirm.rounds
    confirmation = _ConfirmationShape(
        config.confirm.top_k,
        len(one_liners),
        rounds,
        config.measure.warmup + config.confirm.repeats,
        confirmation_protocol(config.measure, config.confirm, rounds).round_limit / rounds,
    )
    try:
        rewards = with_measured_noise(config.reward, search_check)
        searched = config.model_copy(update={"reward": rewards})
        fixed, trials_s = _timed_search(session, space, strategy, resumed, searched, confirmation)
    finally:  # keep the time spent, so a resumed run reports the sum of its parts
        RunMeta.write(store, wall_s=wall_before + deadline.clock() - deadline.started)
    times = {"setup": setup_s, "search": deadline.clock() - deadline.started - setup_s}
    split = {"trials": round(trials_s, 2), "strategy": round(times["search"] - trials_s, 2)}
    RunMeta.write(store, free_knobs=fixed, fp32_plan_hash=fp32.hash, search_split_s=split)
    summary = _confirm_and_export(session, space, fp32, one_liners, confirmation, times)
    RunMeta.write(store, wall_s=wall_before + deadline.clock() - deadline.started, time_s=times)
    summary.update(_time_fields(store, deadline), references_before_search=bar or None)
    summary["backend_choice"] = RunMeta.read(store).backend_choice
    write_json(session.run.best / "summary.json", summary)
    winner = store.confirmations()[summary["plan_hash"]].plan
    session.monitor.text("winner", _winner_markdown(summary, space, winner))
    return summary


@dataclass(frozen=True)
class _ConfirmationShape:
    """The confirmation a search leaves time for.

    Finalists (``confirm.top_k``) and one-liners beside FP32, rounds, runs of each per round, and the rounds it may
    time per round it needs (the round limit of ``measure.max_rounds``).
    """

    finalists: int
    references: int
    rounds: int
    runs_per_round: int
    limit_factor: float

    def finalists_of(self, trials: Sequence[TrialResult], searching: bool) -> int:
        """The finalists there can be: ``finalists``, or fewer where the search measured fewer plans.

        While it is ``searching``, one more than it has measured (the next build may be one): a detector whose
        first trial took 7 s stopped its search there, leaving time for five finalists it did not have.
        """
        measured = len({trial.plan_hash for trial in trials if trial.ok})
        return max(1, min(self.finalists, measured + int(searching)))


def _timed_search(
    session: _Session,
    space: SearchSpace,
    strategy: str,
    resumed: bool,
    searched: TuneConfig,
    confirmation: _ConfirmationShape,
) -> tuple[dict[str, KnobValue], float]:
    """The search, its driver's deadline moved after every trial to leave the confirmation the time it needs.

    Returns:
        The free knobs the seeds fixed, and the seconds the search's builds took (the rest was the strategy's).
    """
    config, deadline, store = session.config, session.deadline, session.store

    def leave_time_for_the_confirmation() -> None:
        if deadline.total_s is None:  # no minutes: nothing to leave, and no reason to read every trial again
            return
        trials = list(store.trials())
        costs = TrialCosts.of(trials, confirmation.limit_factor, config.measure.busy_patience_s)
        plans = confirmation.finalists_of(trials, searching=True) + confirmation.references
        left = deadline.search_left_s(costs, plans, confirmation.rounds, confirmation.runs_per_round)
        driver.deadline = driver.clock() + left

    callbacks = [session.monitor, _Bookkeeping(store, leave_time_for_the_confirmation)]
    driver = Driver.for_budget(session.evaluator, config.budget, space, callbacks=callbacks)
    leave_time_for_the_confirmation()
    fixed = search(searched, space, driver, session.evaluator, session.run, strategy, resumed)
    if driver.out_of_time:
        say(
            f"the search stopped at budget.minutes={config.budget.minutes:g} after {driver.builds} of "
            f"{config.budget.builds} builds, leaving time to confirm the finalists"
        )
    return fixed, driver.build_s


def _confirm_and_export(
    session: _Session,
    space: SearchSpace,
    fp32: Plan,
    one_liners: list[Plan],
    confirmation: _ConfirmationShape,
    times: dict[str, float],
) -> dict[str, Any]:
    """The confirmation cut to the time left, then the export; adds their seconds to ``times``."""
    config, store, deadline = session.config, session.store, session.deadline
    shares = {layer.name: layer.runtime_share for layer in space.layers if layer.runtime_share is not None}
    trials = list(store.trials())
    bound = deadline if deadline.total_s is not None else RunDeadline.for_confirmation(times["search"], deadline.clock)
    allowance_s = round(bound.left_s(), 1)
    size = bound.size_confirmation(
        TrialCosts.of(trials, confirmation.limit_factor, config.measure.busy_patience_s),
        confirmation.finalists_of(trials, searching=False),
        len(one_liners),
        confirmation.rounds,
        confirmation.runs_per_round,
    )
    if size.note:
        say(size.note)
    started = deadline.clock()
    knobs = dict(space.plan().knobs)
    confirm_finalists(session.evaluator, config.finalists, config.confirm, fp32, one_liners, shares, size, knobs)
    times["confirmation"] = deadline.clock() - started
    RunMeta.write(store, time_s=times, confirmation_cut=size.note, confirmation_allowance_s=allowance_s)
    # Ranked over every confirmation in the store: an earlier run's (imported with --from, or confirmed before a
    # resume) can outrank this run's finalists.
    started = deadline.clock()
    summary = export_ranked(session.run, session.evaluator, config.accuracy_budget, config.metric.name)
    times["export"] = deadline.clock() - started
    return summary


def _time_fields(store: TrialStore, deadline: RunDeadline) -> dict[str, Any]:
    """``wall_s`` (the whole run, export included), ``time_s`` (where it went) and the budget, for summary.json."""
    meta = RunMeta.read(store)
    wall = float(meta.wall_s)
    return {
        "wall_s": wall,
        "time_s": {name: round(seconds, 2) for name, seconds in meta.time_s.items()},
        "time_shares": {name: round(seconds / wall, 3) for name, seconds in meta.time_s.items()} if wall else {},
        "time_budget_s": deadline.total_s,
        "confirmation_allowance_s": meta.confirmation_allowance_s,
        "search_time_s": meta.search_split_s or None,
        "confirmation_cut": meta.confirmation_cut,
    }


def _winner_markdown(summary: dict[str, Any], space: SearchSpace, winner: Plan) -> str:
    lines = ["| layer | op | precision |", "|---|---|---|"]
    precisions = winner.precision_map
    lines += [f"| {layer.name} | {layer.op_type} | {precisions.get(layer.name)} |" for layer in space.layers]
    head = (
        f"winner: {summary['winner']['speedup']:.2f}x, drop {summary['winner']['accuracy_drop']:.4g} "
        f"on held-out data; knobs: {winner.knob_map}"
    )
    return head + "\n\n" + "\n".join(lines)
