"""A tuning run from start to export: search, confirm the finalists on held-out data, export the winner."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from autotune.api import analyze, check_data, references
from autotune.backends import searching_references
from autotune.config import ConfigError, TuneConfig
from autotune.files import write_json
from autotune.harness import Evaluator
from autotune.harness.deadline import MIN_CONFIRM_ROUNDS, ConfirmationSize, RunDeadline, TrialCosts
from autotune.harness.earlier_runs import import_runs
from autotune.harness.identity import KEY_META, check_comparable, check_resumable, comparability_key
from autotune.harness.prepare import Stages
from autotune.harness.priors import prior_inputs, store_prior_inputs
from autotune.harness.process import ChildRunner
from autotune.harness.selfcheck import (
    check_confirmation_timing,
    check_search_timing,
    confirmation_noise,
    confirmation_rounds,
    say,
    summary_fields,
    with_measured_noise,
)
from autotune.measure import Busy
from autotune.model import LoadedModel
from autotune.monitor import RunMonitor
from autotune.plan import INT8_SCHEME_KNOB, PRECISIONS, KnobValue, Plan
from autotune.rundir import RunDir
from autotune.runmeta import RunMeta
from autotune.search.agent import AgentPaths, TrialModels
from autotune.search.driver import Driver
from autotune.search.estimate import ACCURACY_KNOBS, RefittedEstimates, fit_surrogate
from autotune.search.registry import STRATEGIES, SearchInputs, run_strategy
from autotune.search.reward import meets_budget
from autotune.search.select import confirmation_order, expected_speedups, profile_speedups, ranking
from autotune.search.space import SearchSpace
from autotune.store import TrialStore
from autotune.trial import BACK_TO_BACK, ONE_LAUNCH, TrialResult, ratio


def confirm(evaluator: Evaluator, store: TrialStore, plans: list[Plan], rounds: int | None = None) -> list[TrialResult]:
    """Confirms each plan once per run (a resumed run reuses earlier confirmations); the new ones side by side."""
    done = {**store.confirmations(), **{r.plan_hash: r for r in store.references().values()}}
    fresh = [plan for plan in plans if plan.hash not in done]
    if fresh:
        done.update((result.plan_hash, result) for result in evaluator.confirm_side_by_side(fresh, rounds))
    return [done[plan.hash] for plan in plans]


def finalist_order(
    trials: Sequence[TrialResult],
    config: TuneConfig,
    fp32: Plan,
    runtime_shares: Mapping[str, float] | None = None,
    knob_defaults: Mapping[str, KnobValue] | None = None,
) -> tuple[list[Plan], dict[str, float]]:
    """A run's measured plans in the order they are confirmed (the first ``confirm.top_k`` are the finalists).

    Ranked by what the plans are expected to hold, not by one short measurement each: with the FP32 profile's
    runtime shares, by the additive model whose per-layer savings are the profile's (``PROFILE_WEIGHT``), alone;
    without them, by the mean of each plan's measurement and a model fitted from zero
    (:func:`autotune.search.select.expected_speedups`). FP32 is left out (it is confirmed as the reference).

    Args:
        trials: The run's trials.
        config: The run's config.
        fp32: The FP32 reference's plan.
        runtime_shares: Layer name to its share of FP32 runtime (layers the profile did not time left out).
        knob_defaults: Each knob's default, which the model gives no term, as in the search; None: ``fp32``'s knobs
            (a backend that builds its reference at other values says so in ``fp32_reference_knobs``).

    Returns:
        The plans in order, and each measured plan's expected speedup by hash.
    """
    defaults = dict(fp32.knobs) if knob_defaults is None else dict(knob_defaults)
    expected = profile_speedups(trials, defaults, runtime_shares, tuple(fp32.precision_map)) if runtime_shares else None
    if expected is None:
        expected = expected_speedups(trials, fit_surrogate(trials, defaults, ACCURACY_KNOBS))
    order = [r.plan for r in confirmation_order(trials, config, expected) if r.plan_hash != fp32.hash]
    return order, expected


def confirm_finalists(
    evaluator: Evaluator,
    store: TrialStore,
    config: TuneConfig,
    fp32: Plan,
    one_liners: Sequence[Plan] = (),
    runtime_shares: Mapping[str, float] | None = None,
    size: ConfirmationSize | None = None,
    knob_defaults: Mapping[str, KnobValue] | None = None,
) -> list[TrialResult]:
    """Confirms the best bets, FP32 and the backend's one-liners side by side, in the same rounds.

    The winner is the fastest finalist, so the finalists are timed together: machine drift between passes then
    falls on all of them alike instead of deciding which one wins; the one-liners are timed beside them by the
    same harness. While no finalist meets the budget on held-out data, and time is left for it, goes on down the
    list, up to as many more (each confirmed alone). A one-liner is stored apart from the finalists and never
    exported.

    Args:
        evaluator: The run's evaluator.
        store: The run's store.
        config: The run's config.
        fp32: The FP32 reference's plan, confirmed beside the finalists.
        one_liners: The backend's one-liners to time beside them.
        runtime_shares: Layer name to its share of FP32 runtime (``finalist_order``).
        size: How many finalists and one-liners, in how many rounds (``RunDeadline.size_confirmation``); None:
            ``confirm.top_k`` finalists, every one-liner given, ``confirm.rounds``, with time for more.
        knob_defaults: Each knob's default (``finalist_order``).

    Returns:
        The finalists' and FP32's confirmations (not the one-liners').
    """
    order, _ = finalist_order(list(store.trials()), config, fp32, runtime_shares, knob_defaults)
    size = size or ConfirmationSize(config.confirm.top_k, len(one_liners), config.confirm.rounds, spare=True)
    if size.finalists == 0:  # no time for any finalist: FP32 alone, the fewest rounds, is what gets exported
        return confirm(evaluator, store, [fp32], MIN_CONFIRM_ROUNDS)
    rounds = None if size.rounds == config.confirm.rounds else size.rounds
    finalists = [*order[: size.finalists], fp32]
    one_liners = list(one_liners)[: size.references]
    confirmed = confirm(evaluator, store, [*finalists, *one_liners], rounds)[: len(finalists)]
    confirmed = check_confirmation_timing(
        evaluator, store, config.confirm, confirmed, fp32, one_liners, rounds, size.spare
    )
    for plan in order[size.finalists : 2 * size.finalists] if size.spare else ():
        if any(meets_budget(r, config.accuracy_budget) for r in confirmed if r.plan_hash != fp32.hash):
            break
        confirmed += confirm(evaluator, store, [plan], rounds)
    return confirmed


def one_liner_plans(evaluator: Evaluator, layers: list[str]) -> list[Plan]:
    """The reference plans of the backend's one-liners that ``confirm.references`` asks for (default all).

    By default a run bounded by ``budget.minutes`` leaves out the one-liners whose build is a search of its own
    (``Backend.searching_references``), saying so in one line: one of them took longer than the whole run.
    """
    config = evaluator.config
    wanted = config.confirm.references  # None: every one the backend offers
    names = [name for name in evaluator.references() if wanted is None or name in wanted]
    slow = [
        n for n in names if wanted is None and config.budget.minutes and n in searching_references(config.backend.name)
    ]
    if slow:
        say(
            f"budget.minutes is set: {', '.join(slow)} (a search of its own, minutes to build) is not timed beside "
            "the finalists; name it in confirm.references to time it"
        )
    return [Plan.reference_plan(layers, name) for name in names if name not in slow]


def reference_rows(store: TrialStore, winner: TrialResult, accuracy_budget: float) -> dict[str, Any]:
    """The one-liners measured in a run beside its winner, for the summary.

    Returns:
        ``references`` (name to metrics, status and error), ``best_reference`` (the fastest one-liner within the
        accuracy budget, or None), ``winner_over_best_reference`` (the winner's speedup over FP32 divided by that
        one-liner's: one launch at a time), ``winner_over_best_reference_back_to_back`` (the fastest one-liner
        within the budget back to back, its latency per launch over the winner's; None where the backend has no
        such timer) and ``reference_note``: one line when a one-liner within the budget is faster than the
        winner, else None. The winner is exported either way: the user decides.
    """
    references = store.references()
    rows = {
        name: {"plan_hash": r.plan.hash, "status": r.status, "error": r.error, **_metrics(r)}
        for name, r in references.items()
    }
    within = [(name, r) for name, r in references.items() if meets_budget(r, accuracy_budget) and r.speedup]
    best = max(within, key=lambda item: item[1].speedup, default=None)
    note = None
    one_launch = None
    if best is not None:
        name, result = best
        one_launch = ratio(result, winner, ONE_LAUNCH) or 0.0
        if result.speedup > (winner.speedup or 0.0):
            note = (
                f"the one-liner {name} beats the winner within the accuracy budget ({result.speedup:.2f}x against "
                f"{winner.speedup or 0.0:.2f}x over FP32, held-out data); the winner is exported as ranked: "
                f"compare them with `autotune evaluate CONFIG --plan {name}`"
            )
    # Back to back the fastest one-liner within the budget may be another than one launch at a time.
    back_to_back = [ratio(r, winner, BACK_TO_BACK) for _, r in within]
    back_to_back = [value for value in back_to_back if value is not None]
    return {
        "references": rows,
        "best_reference": best[0] if best else None,
        "winner_over_best_reference": one_launch,
        "winner_over_best_reference_back_to_back": min(back_to_back, default=None),
        "reference_note": note,
    }


def export_ranked(
    run: RunDir, config: TuneConfig, evaluator: Evaluator, store: TrialStore, rank: int = 1, out_dir: Path | None = None
) -> dict[str, Any]:
    """Writes the plan of a given confirmation rank: deployable model, ``plan.json`` and ``summary.json``.

    The summary's ``ranking`` lists every confirmed plan of the store, best first.

    Raises:
        ConfigError: No confirmed plan has that rank.
    """
    confirmed = ranking(list(store.confirmations().values()), config.accuracy_budget, confirmation_noise(store))
    within = [r for r in confirmed if meets_budget(r, config.accuracy_budget)]
    if not 1 <= rank <= len(within):
        raise ConfigError(f"rank {rank} does not exist: {len(within)} confirmed plans meet the accuracy budget")
    chosen = within[rank - 1]
    out_dir = out_dir or run.best
    files = evaluator.export(chosen.plan, out_dir)
    write_json(out_dir / "plan.json", chosen.plan.to_dict())
    meta = RunMeta.read(store)
    reference = store.confirmations().get(str(meta.fp32_plan_hash or ""))
    summary = {
        "rank": rank,
        "plan_hash": chosen.plan.hash,
        "plan": chosen.plan.describe(),
        "files": files,
        "winner": _metrics(chosen),
        "fp32_reference": _metrics(reference) if reference else None,
        **reference_rows(store, chosen, config.accuracy_budget),
        "accuracy_budget": config.accuracy_budget,
        "metric": config.metric.name,
        "builds": store.builds(),
        "imported_trials": len(store.imported()),
        "cache_hits": int(meta.cache_hits),
        "free_knobs": meta.free_knobs,
        "wall_s": float(meta.wall_s),
        "setup_s": meta.setup_s,
        "setup_stages_s": meta.setup_stages_s,
        "machine": (store.get_meta(KEY_META, {}) or {}).get("machine"),
        "int8_arithmetic": _int8_arithmetic(evaluator, chosen.plan),
        "ranking": [{"plan_hash": r.plan.hash, "plan": r.plan.describe(), **_metrics(r)} for r in confirmed],
        **summary_fields(store),
    }
    write_json(out_dir / "summary.json", summary)
    return summary


def _metrics(result: TrialResult) -> dict[str, Any]:
    return {
        "split": result.split,
        "speedup": result.speedup,
        "latency_ms": result.latency_ms,
        "latency_iqr_ms": result.latency_iqr_ms,
        "reference_latency_ms": result.reference_latency_ms,
        "accuracy": result.accuracy,
        "reference_accuracy": result.reference_accuracy,
        "accuracy_drop": result.accuracy_drop,
        "fidelity": result.fidelity,
        "protocol": result.protocol,
        "back_to_back_ms": result.back_to_back_ms,
        "reference_back_to_back_ms": result.reference_back_to_back_ms,
        # A one-liner's build is the plain compile of the users' module, beside which a trial build's cost reads
        "build_s": result.build_s,
        "build_stages_s": result.build_stages_s,
    }


class MonitoredHarness:
    """The run's evaluator as the driver's harness: every result goes to the monitor, store hits are counted."""

    def __init__(self, evaluator: Evaluator, monitor: RunMonitor):
        self.evaluator = evaluator
        self.monitor = monitor
        self.said: set[str] = set()  # what the run has told its user about a shared machine, once each
        self.landed: Callable[[], None] = lambda: None  # called after each result is recorded

    @property
    def builds(self) -> int:
        """Builds spent so far (store hits excluded)."""
        return self.evaluator.builds

    @property
    def workers(self) -> int:
        """Builds that run at once."""
        return self.evaluator.workers

    def evaluate_many(self, plans: Sequence[Plan], limit: int | None = None) -> Iterator[TrialResult]:
        """The evaluator's results, each recorded as it lands."""
        store = self.evaluator.store
        for result in self.evaluator.evaluate_many(plans, limit):
            self.monitor.record(result)
            if result.from_store:
                RunMeta.count_cache_hit(store)
            else:
                self._say_if_busy(result)
            self.landed()
            yield result

    def _say_if_busy(self, result: TrialResult) -> None:
        """One line the first time other work slows a trial, and one the first time it makes one unmeasurable."""
        kind = "too_busy" if result.too_busy else "shared" if result.shared else None
        if kind is None or kind in self.said:
            return
        self.said.add(kind)
        later = "later trials are timed the same way; the summary counts them"
        say(f"{Busy.from_dict(result.busy).describe()} (build {self.builds}); {later}")


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
    paths = None if run is None else AgentPaths(run.tensorboard, run.checkpoints, resume)
    models = lambda seeded: _trial_models(config, seeded, evaluator)  # noqa: E731
    return run_strategy(strategy, driver, space, SearchInputs(config, driver.workers, models, paths))


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
    deadline = RunDeadline(config.budget.minutes, time.time())
    stage = Stages()
    trial_process = Evaluator.start_early(config, isolate)  # loads the backend while this process analyses
    try:
        # Model, backend, search space and data are checked before the run directory exists: a run that cannot
        # start leaves nothing behind that a resume would trust.
        model, space = _analyze(config, trial_process, stage)
        with stage("check_data"):
            check_data(config, model)
            _check_request(config, space, strategy)
        key = comparability_key(config, model)
        if resume_dir is None:
            check_comparable(config.from_runs, key)
            run = RunDir.create(config)
        with TrialStore(run.store) as store:
            if resume_dir is not None:
                check_resumable(store, key, resume_dir)  # another machine or runtime: refused in one line
                strategy = RunMeta.read(store).strategy or strategy
            else:
                store.set_meta(KEY_META, key)
                RunMeta.write(store, strategy=strategy, imported_from=import_runs(store, config.from_runs, key))
            monitor = RunMonitor(config, run.tensorboard, builds_done=store.builds(), progress=progress)
            monitor.seed(list(store.trials()))
            try:
                with stage("trial_process"):
                    evaluator = Evaluator(config, store, isolate=isolate, started=trial_process)
                with evaluator:
                    stage.seconds.update({f"trial_process.{k}": v for k, v in evaluator.setup_stages_s.items()})
                    summary = _search_and_confirm(
                        run, config, space, evaluator, monitor, strategy, resume_dir, stage, deadline
                    )
            finally:
                monitor.close()
    finally:
        if trial_process is not None:
            trial_process.stop()  # the evaluator stopped it already, unless the run ended before one took it
    write_json(run.summary, summary)
    return summary


def _analyze(config: TuneConfig, trial_process: ChildRunner | None, stage: Stages) -> tuple[LoadedModel, SearchSpace]:
    """``analyze`` as stage ``analyze``; the trial process reads the model once ``analyze`` hands it on."""
    started = time.perf_counter()

    def model_ready() -> None:
        stage.seconds["analyze.model"] = time.perf_counter() - started
        if trial_process is not None:
            trial_process.release()

    with stage("analyze"):
        return analyze(config, model_ready=model_ready)


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


def _search_and_confirm(
    run: RunDir,
    config: TuneConfig,
    space: SearchSpace,
    evaluator: Evaluator,
    monitor: RunMonitor,
    strategy: str,
    resume_dir: Path | None,
    stage: Stages,
    deadline: RunDeadline,
) -> dict[str, Any]:
    """The search through the driver (its wall time kept, even on Ctrl-C), then the confirmation and the export.

    ``stage`` holds the set-up's stages so far; the timing self-check is the last, then the set-up is recorded.
    The search, the confirmation and the export share what ``deadline`` leaves (``autotune.harness.deadline``).
    """
    store = evaluator.store
    wall_before = RunMeta.read(store).wall_s
    fp32 = evaluator.fp32_plan()  # the reference's own plan: the self-checks time the reference against itself
    with stage("timing_self_check"):
        search_check = check_search_timing(evaluator, store, fp32)
    setup_s = deadline.clock() - deadline.started
    RunMeta.write(store, setup_s=setup_s, setup_stages_s=dict(stage.seconds))
    searched = with_measured_noise(config, search_check)
    one_liners = one_liner_plans(evaluator, space.layer_names)
    rounds = confirmation_rounds(config.confirm, search_check) or config.confirm.rounds
    runs = config.measure.warmup + config.confirm.repeats
    try:
        harness = MonitoredHarness(evaluator, monitor)
        driver = Driver.for_budget(harness, config.budget, space)

        def leave_time_for_the_confirmation() -> None:
            costs = TrialCosts.of(list(store.trials()))
            left = deadline.search_left_s(costs, config.confirm.top_k + len(one_liners), rounds, runs)
            if driver.deadline is not None or left != float("inf"):
                driver.deadline = driver.clock() + left

        harness.landed = leave_time_for_the_confirmation
        leave_time_for_the_confirmation()
        fixed = search(searched, space, driver, evaluator, run, strategy, resume_dir is not None)
        if driver.out_of_time:
            say(
                f"the search stopped at budget.minutes={config.budget.minutes:g} after {driver.builds} of "
                f"{config.budget.builds} builds, leaving time to confirm the finalists"
            )
    finally:  # keep the time spent, so a resumed run reports the sum of its parts
        RunMeta.write(store, wall_s=wall_before + deadline.clock() - deadline.started)
    search_s = deadline.clock() - deadline.started - setup_s
    RunMeta.write(store, free_knobs=fixed, fp32_plan_hash=fp32.hash)
    shares = {layer.name: layer.runtime_share for layer in space.layers if layer.runtime_share is not None}
    size = deadline.size_confirmation(
        TrialCosts.of(list(store.trials())), config.confirm.top_k, len(one_liners), rounds, runs
    )
    if size.note:
        say(size.note)
    confirmed_at = deadline.clock()
    confirm_finalists(evaluator, store, config, fp32, one_liners, shares, size, dict(space.plan().knobs))
    exported_at = deadline.clock()
    times = {"setup": setup_s, "search": search_s, "confirmation": exported_at - confirmed_at}
    RunMeta.write(store, wall_s=wall_before + exported_at - deadline.started, time_s=times)
    # Ranked over every confirmation in the store: an earlier run's (imported with --from, or confirmed before a
    # resume) can outrank this run's finalists.
    summary = export_ranked(run, config, evaluator, store)
    times["export"] = deadline.clock() - exported_at
    RunMeta.write(store, wall_s=wall_before + deadline.clock() - deadline.started, time_s=times)
    summary.update(_time_fields(store, deadline, size))
    write_json(run.best / "summary.json", summary)
    winner = store.confirmations()[summary["plan_hash"]].plan
    monitor.text("winner", _winner_markdown(summary, space, winner))
    return summary


def _time_fields(store: TrialStore, deadline: RunDeadline, size: ConfirmationSize) -> dict[str, Any]:
    """``wall_s`` (the whole run, export included), ``time_s`` (where it went) and the budget, for summary.json."""
    meta = RunMeta.read(store)
    wall = float(meta.wall_s)
    return {
        "wall_s": wall,
        "time_s": {name: round(seconds, 2) for name, seconds in meta.time_s.items()},
        "time_shares": {name: round(seconds / wall, 3) for name, seconds in meta.time_s.items()} if wall else {},
        "time_budget_s": deadline.total_s,
        "confirmation_cut": size.note,
    }


def _int8_arithmetic(evaluator: Evaluator, winner: Plan) -> dict[str, Any] | None:
    """The backend's INT8 scheme and probe (``Evaluator.int8_arithmetic``), and the scheme the winner was built with.

    Where a config searches ``int8_scheme`` the winner may run another exact scheme than the default.
    """
    arithmetic = evaluator.int8_arithmetic()
    if arithmetic is None:
        return None
    return {**arithmetic, "winner_scheme": winner.knob(INT8_SCHEME_KNOB, arithmetic["scheme"])}


def _winner_markdown(summary: dict[str, Any], space: SearchSpace, winner: Plan) -> str:
    lines = ["| layer | op | precision |", "|---|---|---|"]
    precisions = winner.precision_map
    lines += [f"| {layer.name} | {layer.op_type} | {precisions.get(layer.name)} |" for layer in space.layers]
    head = (
        f"winner: {summary['winner']['speedup']:.2f}x, drop {summary['winner']['accuracy_drop']:.4g} "
        f"on held-out data; knobs: {winner.knob_map}"
    )
    return head + "\n\n" + "\n".join(lines)
