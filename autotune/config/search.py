"""The search's own sections of the config: the reward, the surrogate planner and the PPO policy.

``autotune.config.schema`` holds them in ``TuneConfig`` and re-exports them; they live here so that each module stays a
readable size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class StrictSection(BaseModel):
    """A config section: unknown keys are errors, values are frozen, attribute docstrings are the descriptions."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class RewardConfig(StrictSection):
    """``log(t_ref / t_plan) - accuracy_penalty * excess``, where excess is ``max(0, drop - accuracy_budget)``.

    With ``penalty_units: budget`` (default) the excess is measured in budgets (``excess / accuracy_budget``), so
    one penalty weight works for any metric scale: with the default 5, a plan 10% over the budget loses 0.5, as
    much as a 1.65x speedup gains. With ``metric`` the excess is in the metric's own units. Failures get ``failure``.
    """

    accuracy_penalty: float = Field(5.0, ge=0)
    """The penalty per unit of excess (``penalty_units``) over the accuracy budget."""
    penalty_units: Literal["budget", "metric"] = "budget"
    """``budget``: excess counted in accuracy budgets; ``metric``: in the metric's own units."""
    failure: float = -1.0
    """The reward of a plan that failed to build or run."""
    tie_within: float | None = Field(None, ge=0)
    """Relative speedup differences the reward treats as ties (``autotune.search.reward.latency_gain``); None: the
    noise of the run's own FP32 self-check (``autotune.measure.confidence.SelfCheck``), 0: none."""


class PPOConfig(StrictSection):
    """MaskablePPO hyperparameters, sized for steps that cost seconds: an update every few builds."""

    episodes_per_update: int = Field(8, gt=0)
    """Episodes (plans) collected per policy update; n_steps = this x the episode length."""
    minibatches: int = Field(4, gt=0)
    """Minibatches each update's rollout is cut into."""
    n_epochs: int = Field(10, gt=0)
    """Passes over each rollout per update."""
    learning_rate: float = Field(3e-4, gt=0)
    """Adam's learning rate."""
    gamma: float = Field(1.0, gt=0, le=1)
    """Discount per step; 1: none (an episode is one plan, its return the plan's reward)."""
    gae_lambda: float = Field(0.95, gt=0, le=1)
    """GAE's bias-variance trade-off of the advantage estimates."""
    ent_coef: float = Field(0.01, ge=0)
    """Entropy bonus weight: keeps the policy exploring."""
    clip_range: float = Field(0.2, gt=0)
    """PPO's clipping of the policy ratio."""
    net_arch: list[Annotated[int, Field(gt=0)]] = [64, 64]
    """Hidden layer widths of the policy and value networks."""
    checkpoint_every_builds: int = Field(25, gt=0)
    """Save the policy to ``checkpoints/`` every this many builds."""
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


class PlannerConfig(StrictSection):
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
    the penalty of over-budget plans drives toward FP32; 0: off (``autotune/search/agent.py``, ``imitate``)."""
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


@dataclass(frozen=True)
class FinalistRule:
    """What orders a run's measured plans for confirmation (``autotune.search.select.confirmation_order``)."""

    accuracy_budget: float
    """The largest accuracy drop allowed (``accuracy_budget``)."""
    search_budget: float
    """The drop the search aims at (``TuneConfig.search_budget``)."""
    reward: RewardConfig
    """How plans outside the budgets are ranked (``reward``)."""
    top_k: int
    """Finalists confirmed (``confirm.top_k``)."""
    bold_places: int
    """Of them, the most given to plans between the search budget and the budget (``planner.bold_places``)."""


@dataclass(frozen=True)
class PlanningRule:
    """What the surrogate planner reads (``autotune.search.planner.Planner``)."""

    planner: PlannerConfig
    """The ``planner`` section."""
    seed: int
    """The run's seed."""
    search_budget: float
    """The drop the search aims at (``TuneConfig.search_budget``)."""
    bold_budget: float
    """The drop the bold plans aim at (``TuneConfig.bold_budget``)."""
    builds: int
    """The run's build budget (``budget.builds``): the probes' design is sized to it."""
