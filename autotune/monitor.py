"""What a person watches during a run: TensorBoard scalars, and progress with the best plan so far.

The monitor is a callback of the run's driver (``autotune.search.driver.DriverCallback``): the driver hands it every
result as it lands. On a terminal the progress is a bar; written to a file or a pipe (a CI log,
``make demo > demo.log``) it is a plain line now and then, since every refresh of a bar would be a line of the log.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from autotune.config.schema import RewardConfig
from autotune.measure.interference import Busy
from autotune.measure.selfcheck import say
from autotune.run.trial import TrialResult
from autotune.search.reward import meets_budget, reward

if TYPE_CHECKING:
    from autotune.search.driver import Driver

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


class PlainProgress:
    """Progress as plain lines: one when a tenth of the builds and a minute have both passed since the last one.

    It keeps the attributes of the bar it stands in for (``n``, ``total``, ``postfix``), and its last line at
    ``close`` says where the builds ended.

    Args:
        total: Builds of the run's budget.
        initial: Builds already done (resume).
        stream: Where the lines go.
        min_interval_s: At least this long between two lines.
        clock: Seconds, for tests.
    """

    def __init__(
        self,
        total: int,
        initial: int = 0,
        stream: TextIO | None = None,
        min_interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total, self.n, self.postfix = total, initial, ""
        self._stream = stream if stream is not None else sys.stderr
        self._clock, self._min_interval_s = clock, min_interval_s
        self._start = self._last_time = clock()
        self._last_n = initial
        self._step = max(1, math.ceil(total / 10))

    def update(self, builds: int = 1) -> None:
        """Counts builds; writes a line when a tenth of the budget and ``min_interval_s`` passed since the last."""
        self.n += builds
        if self.n - self._last_n >= self._step and self._clock() - self._last_time >= self._min_interval_s:
            self._line()

    def set_postfix_str(self, text: str) -> None:
        """What the next line says after the count: the best plan so far."""
        self.postfix = text

    def close(self) -> None:
        """Writes the last count, unless the last line already said it."""
        if self.n != self._last_n:
            self._line()

    def _line(self) -> None:
        now = self._clock()
        share = f" ({100 * self.n / self.total:.0f} %)" if self.total else ""
        minutes, seconds = divmod(int(now - self._start), 60)
        best = f"; {self.postfix}" if self.postfix else ""
        print(f"autotune: builds {self.n}/{self.total}{share} at {minutes}:{seconds:02d}{best}", file=self._stream)
        self._stream.flush()
        self._last_n, self._last_time = self.n, now


def progress_display(total: int, initial: int) -> Any:
    """A tqdm bar on a terminal's stderr; ``PlainProgress`` lines where stderr is a file or a pipe."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc="builds", unit="build")
    return PlainProgress(total, initial)


class RunMonitor:
    """Records every episode's trial to TensorBoard and keeps the best-so-far; a callback of the run's driver.

    Tags: ``trial/*`` per episode (reward, speedup, latency, accuracy, drop, build seconds, cache hit, failure),
    ``best/*`` against builds (reward, speedup, drop of the best plan so far).

    Args:
        rewards: The run's ``reward`` section: how each trial is scored.
        search_budget: The drop the search aims at (``TuneConfig.search_budget``).
        log_dir: TensorBoard directory.
        total_builds: The run's build budget (``budget.builds``), the progress's end.
        builds_done: Builds already in the store (resume).
        progress: Show progress on stderr (``progress_display``).
    """

    def __init__(
        self,
        rewards: RewardConfig,
        search_budget: float,
        log_dir: Path,
        total_builds: int,
        builds_done: int = 0,
        progress: bool = True,
    ):
        from torch.utils.tensorboard import SummaryWriter

        self.rewards, self.search_budget = rewards, search_budget
        self.said: set[str] = set()  # what the run has told its user about a shared machine, once each
        self.writer = SummaryWriter(str(log_dir))
        self.writer.add_custom_scalars(CUSTOM_SCALARS)
        self.episodes = 0
        self.builds = builds_done
        self.best_reward = -math.inf
        self.best: TrialResult | None = None
        self._bar: Any = None
        if progress:
            self._bar = progress_display(total_builds, builds_done)

    def seed(self, results: list[TrialResult]) -> None:
        """Takes the best-so-far from trials already in the store (resume)."""
        for result in results:
            self._update_best(result)

    def _update_best(self, result: TrialResult) -> bool:
        value = reward(result, self.rewards, self.search_budget)
        if result.ok and value > self.best_reward:
            self.best_reward, self.best = value, result
            return True
        return False

    def record(self, result: TrialResult) -> float:
        """Logs one episode; returns its reward."""
        value = reward(result, self.rewards, self.search_budget)
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
                    "trial/within_budget": float(meets_budget(result, self.search_budget)),
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

    def on_result(self, result: TrialResult, driver: Driver) -> None:
        """Records a result the driver's build brought (``DriverCallback``), and says when other work slowed it."""
        self.record(result)
        if not result.from_store:
            self._say_if_busy(result, driver.builds)

    def _say_if_busy(self, result: TrialResult, builds: int) -> None:
        """One line the first time other work slows a trial, and one the first time it makes one unmeasurable."""
        kind = "too_busy" if result.too_busy else "shared" if result.shared else None
        if kind is None or kind in self.said:
            return
        self.said.add(kind)
        later = "later trials are timed the same way; the summary counts them"
        say(f"{Busy.from_dict(result.busy).describe()} (build {builds}); {later}")

    def text(self, tag: str, text: str) -> None:
        """Writes markdown text to TensorBoard."""
        self.writer.add_text(tag, text, self.builds)

    def close(self) -> None:
        """Flushes and closes."""
        self.writer.flush()
        self.writer.close()
        if self._bar is not None:
            self._bar.close()
