"""What a person watches during a run: TensorBoard scalars, and a progress bar with the best plan so far."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from autotune.config import TuneConfig
from autotune.search.reward import meets_budget, reward
from autotune.trial import TrialResult

CUSTOM_SCALARS = {
    "reward": {
        "reward per episode and best so far": ["Multiline", ["trial/reward", "best/reward"]],
        "failed builds": ["Multiline", ["trial/failed"]],
    },
    "latency": {
        "speedup over FP32": ["Multiline", ["trial/speedup", "best/speedup"]],
        "median latency (ms)": ["Multiline", ["trial/latency_ms"]],
        "build seconds": ["Multiline", ["trial/build_s"]],
    },
    "accuracy": {
        "accuracy drop": ["Multiline", ["trial/accuracy_drop", "best/accuracy_drop"]],
        "accuracy": ["Multiline", ["trial/accuracy"]],
    },
    "agent health": {
        "entropy": ["Multiline", ["train/entropy_loss"]],
        "value loss": ["Multiline", ["train/value_loss"]],
        "explained variance": ["Multiline", ["train/explained_variance"]],
    },
}
"""TensorBoard's Custom Scalars tab groups the tags like this."""


class RunMonitor:
    """Records every episode's trial to TensorBoard and keeps the best-so-far.

    Tags: ``trial/*`` per episode (reward, speedup, latency, accuracy, drop, build seconds, cache hit, failure),
    ``best/*`` against builds (reward, speedup, drop of the best plan so far).

    Args:
        config: The run's config.
        log_dir: TensorBoard directory.
        builds_done: Builds already in the store (resume).
        progress: Show a console progress bar.
    """

    def __init__(self, config: TuneConfig, log_dir: Path, builds_done: int = 0, progress: bool = True):
        from torch.utils.tensorboard import SummaryWriter

        self.config = config
        self.writer = SummaryWriter(str(log_dir))
        self.writer.add_custom_scalars(CUSTOM_SCALARS)
        self.episodes = 0
        self.builds = builds_done
        self.best_reward = -math.inf
        self.best: TrialResult | None = None
        self._bar: Any = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=config.budget.builds, initial=builds_done, desc="builds", unit="build")

    def seed(self, results: list[TrialResult]) -> None:
        """Takes the best-so-far from trials already in the store (resume)."""
        for result in results:
            self._update_best(result)

    def _update_best(self, result: TrialResult) -> bool:
        value = reward(result, self.config.reward, self.config.search_budget)
        if result.ok and value > self.best_reward:
            self.best_reward, self.best = value, result
            return True
        return False

    def record(self, result: TrialResult) -> float:
        """Logs one episode; returns its reward."""
        value = reward(result, self.config.reward, self.config.search_budget)
        self.episodes += 1
        step = self.episodes
        scalars = {
            "trial/reward": value,
            "trial/cache_hit": float(result.from_store),
            "trial/failed": float(not result.ok),
        }
        if result.ok:
            scalars.update(
                {
                    "trial/speedup": result.speedup,
                    "trial/latency_ratio": 1.0 / result.speedup,
                    "trial/latency_ms": result.latency_ms,
                    "trial/accuracy": result.accuracy,
                    "trial/accuracy_drop": result.accuracy_drop,
                    "trial/within_budget": float(meets_budget(result, self.config.search_budget)),
                }
            )
        if not result.from_store:
            self.builds += 1
            scalars["trial/build_s"] = result.build_s
            if self._bar is not None:
                self._bar.update(1)
        for tag, scalar in scalars.items():
            self.writer.add_scalar(tag, scalar, step)
        if self._update_best(result) or not result.from_store:
            if self.best is not None:
                self.writer.add_scalar("best/reward", self.best_reward, self.builds)
                self.writer.add_scalar("best/speedup", self.best.speedup, self.builds)
                self.writer.add_scalar("best/accuracy_drop", self.best.accuracy_drop, self.builds)
        if self._bar is not None and self.best is not None:
            self._bar.set_postfix_str(
                f"best reward {self.best_reward:+.3f} ({self.best.speedup:.2f}x, drop {self.best.accuracy_drop:.4g})"
            )
        return value

    def text(self, tag: str, text: str) -> None:
        """Writes markdown text to TensorBoard."""
        self.writer.add_text(tag, text, self.builds)

    def close(self) -> None:
        """Flushes and closes."""
        self.writer.flush()
        self.writer.close()
        if self._bar is not None:
            self._bar.close()
