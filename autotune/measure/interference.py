"""How much other work the machine did while this process timed: read from Linux's own accounting.

Two readings, both free of any assumption about the model being timed:

- ``others``: the share of the cores this process may run on that went to anything but this process (other
  processes, the kernel's work for them, and on a VM the host's ``steal``), from ``/proc/stat`` less this process's
  own CPU time. It says that the machine is shared; it does not say that the timing suffered (a ``nice`` job takes
  what the timed threads leave idle).
- ``waited``: the seconds this process's threads spent runnable but not running (``/proc/self/task/*/schedstat``,
  the scheduler's run-queue wait), per second of wall time. A thread of the timed engine that waits for a core
  stretches its run by that wait: this is the reading that says a round was slowed by the others.

Neither exists off Linux (or without the scheduler's statistics); ``Sampler.available`` says so and readings are
None there, so a caller can say that it cannot tell. ``Busy`` is what one measurement makes of them for its user.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

_PROC_STAT = Path("/proc/stat")
_TASKS = Path("/proc/self/task")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
SHARE_MIN_S = 0.5
"""The shortest span whose share of core time is read: 50 of the kernel's 10 ms ticks per core."""
TICK_SLACK = 1.5
"""Ticks per core by which the kernel's tick-sampled core time of a span may miss this process's exact CPU time."""
OTHERS_FLOOR = 0.05
"""The least share of the cores other work must take over a round for a wait in it to be theirs: a VM's host and
kernel threads take a per cent or two of an idle machine, which over a round of seconds is more than any tick slack,
while a busy process beside the timed threads takes a third of two cores or more."""
OTHERS_PER_WAIT = 0.25
"""The least core time other work takes, per second this process's threads waited, for the wait to be theirs: a
process that holds one core keeps up to all of our threads waiting on it (two here), and a share of its time falls
in our idle moments."""


def usable_cpus() -> list[int]:
    """The cores this process may run on, in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def describe_cpus(cpus: list[int]) -> str:
    """Cores as a user reads them: ``0-1``, ``0,2,4``."""
    if cpus and cpus == list(range(cpus[0], cpus[-1] + 1)) and len(cpus) > 1:
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(str(cpu) for cpu in cpus)


@dataclass(frozen=True)
class Snapshot:
    """Cumulative counters at one instant.

    Attributes:
        wall_s: ``time.perf_counter()``.
        busy_s: CPU seconds the usable cores spent not idle (steal included), since boot.
        own_s: CPU seconds of this process (its ended threads included).
        waited_ns: Per live thread of this process, the nanoseconds it spent runnable, waiting for a core.
    """

    wall_s: float
    busy_s: float
    own_s: float
    waited_ns: dict[str, int]


@dataclass(frozen=True)
class Reading:
    """What happened between two snapshots.

    Attributes:
        wall_s: Wall seconds between them.
        others: Share of the usable cores' time taken by anything but this process, 0..1; None over less than
            ``SHARE_MIN_S`` (the kernel counts core time in ticks of 10 ms: a shorter span reads 0 or 100 %).
        waited: This process's threads' run-queue wait per wall second (0: never kept from a core).
        others_s: Core seconds other work took over the span, however short (tick-sampled, so within about a tick
            per core; may read a little below 0); None where not read.
    """

    wall_s: float
    others: float | None
    waited: float
    others_s: float | None = None

    @classmethod
    def between(cls, start: Snapshot, end: Snapshot, cores: int) -> Reading:
        """The reading from ``start`` to ``end`` on ``cores`` usable cores."""
        wall = max(end.wall_s - start.wall_s, 1e-9)
        others = (end.busy_s - start.busy_s) - (end.own_s - start.own_s)
        share = min(1.0, max(0.0, others / (wall * cores))) if wall >= SHARE_MIN_S else None
        # Threads alive at both ends: a thread that ended took its counter with it, one that started had none.
        waited = sum(
            max(0, end.waited_ns[tid] - start.waited_ns[tid]) for tid in end.waited_ns.keys() & start.waited_ns
        )
        return cls(wall, share, waited / 1e9 / wall, others)

    def others_cpu_s(self) -> float | None:
        """Core seconds anything but this process took over the span; None where it was not read.

        ``others_s`` where read, else the share times the wall time.
        """
        if self.others_s is not None:
            return self.others_s
        return None if self.others is None else self.others * self.wall_s

    def waited_for_others(self, allowance: float, cores: int) -> bool:
        """This process's threads waited for a core beyond ``allowance`` of the span, and other work ran meanwhile.

        A thread can wait for a core with nothing else on the machine: on a VM, waking an idle virtual core takes the
        host a while, and the engine's threads wake every run; an idle VM read such waits in nearly every round
        (docs/measurement.md#quiet-rounds). Another process that keeps a thread of ours from a core runs on that core
        meanwhile, so its core time covers a good part of the wait (``OTHERS_PER_WAIT``); the kernel counts core time
        in ticks, so less than ``TICK_SLACK`` ticks per core is no other work at all, and less than ``OTHERS_FLOOR``
        of the cores is the machine's own background.
        """
        if self.waited <= allowance:
            return False
        others_s = self.others_cpu_s()
        if others_s is None:
            return True
        floor = max(TICK_SLACK * cores / _TICKS_PER_S, OTHERS_FLOOR * cores * self.wall_s)
        return others_s > floor and others_s >= OTHERS_PER_WAIT * self.waited * self.wall_s


class Sampler:
    """Takes ``Snapshot``s of this process and the cores it may use.

    Args:
        cpus: The cores to account; default the process's affinity.
    """

    def __init__(self, cpus: list[int] | None = None) -> None:
        self.cpus = cpus if cpus is not None else usable_cpus()
        self._random = random.Random(os.getpid())
        self.available = _PROC_STAT.exists() and (_TASKS / str(os.getpid())).exists() and self._schedstat_works()

    @staticmethod
    def _schedstat_works() -> bool:
        try:
            return len((_TASKS / str(os.getpid()) / "schedstat").read_text().split()) >= 2
        except OSError:
            return False

    def snapshot(self) -> Snapshot | None:
        """The counters now, or None where Linux's accounting cannot be read."""
        if not self.available:
            return None
        try:
            busy = self._busy_ticks() / _TICKS_PER_S
            waited = self._waited_ns()
        except (OSError, ValueError):
            return None
        return Snapshot(time.perf_counter(), busy, time.process_time(), waited)

    def _busy_ticks(self) -> int:
        wanted = {f"cpu{cpu}" for cpu in self.cpus}
        busy = 0
        for line in _PROC_STAT.read_text().splitlines():
            name, _, values = line.partition(" ")
            if name not in wanted:
                continue
            # user nice system idle iowait irq softirq steal (guest and guest_nice are inside user and nice)
            ticks = [int(value) for value in values.split()[:8]]
            busy += sum(ticks) - ticks[3] - ticks[4]
        return busy

    @staticmethod
    def _waited_ns() -> dict[str, int]:
        waited = {}
        for task in _TASKS.iterdir():
            try:  # schedstat: ns on a core, ns runnable but waiting for one, timeslices
                waited[task.name] = int((task / "schedstat").read_text().split()[1])
            except OSError:  # the thread ended between the listing and the read
                continue
        return waited

    def back_off(self, longest_s: float) -> float:
        """Sleeps a random part of ``longest_s`` (off the cores, so the others can finish); returns the seconds.

        Random, so that two processes that found each other on the cores do not come back in step.
        """
        seconds = self._random.uniform(0.25, 1.0) * longest_s
        time.sleep(seconds)
        return seconds

    def reading(self, start: Snapshot | None, end: Snapshot | None) -> Reading | None:
        """The reading between two snapshots of this sampler; None if either is."""
        if start is None or end is None:
            return None
        return Reading.between(start, end, len(self.cpus))


@dataclass(frozen=True)
class Busy:
    """How much the machine's other work got in the way of one measurement.

    Attributes:
        rounds: Rounds timed.
        counted: Rounds that counted.
        contended: Rounds in which this process's threads waited for a core beyond ``Protocol.busy_wait``, or that
            fell in a span where other processes took more than ``Protocol.busy_others`` of the cores.
        others: Share of the usable cores that other work took over the measurement (None: Linux's accounting
            could not be read, or the measurement was too short to read it).
        waited: This process's run-queue wait per wall second over the measurement (None: as above).
        cpus: The cores accounted, as a user reads them (``0-1``).
        quiet: Enough rounds counted; False when the measurement ran out of patience without them and timed
            each runner by its own fastest runs (``_from_floors``): the machine was too busy for a paired ratio.
        slower_by: Where not quiet because the reference never ran at the pace earlier processes timed it at on
            this machine: its fastest round's excess over that pace (0.13: 13 % slower), a slow spell of the
            machine itself. None otherwise.
    """

    rounds: int
    counted: int
    contended: int
    others: float | None
    waited: float | None
    cpus: str
    quiet: bool
    slower_by: float | None = None

    @property
    def shared(self) -> bool:
        """Other work took time from the timed threads in at least one round, or the measurement never settled."""
        return self.contended > 0 or not self.quiet

    def describe(self) -> str:
        """One line for the user: how busy, and what the measurement did about it."""
        took = "" if self.others is None else f"other processes took {self.others:.0%} of cores {self.cpus}; "
        what = (
            f"{took}other work got in the way of the timed threads in {self.contended} of {self.rounds} rounds"
            if self.waited is not None
            else "Linux's accounting could not be read"
        )
        if not self.quiet and self.slower_by is not None and self.contended * 2 < self.rounds:
            return (
                f"the machine ran slow: FP32 ran at best {self.slower_by:.0%} slower than its quiet pace on this "
                f"machine (the last minute's, or earlier processes'), and stayed so for the whole wait ({what}): a "
                "slow spell of the host, or of this process; each plan was timed by its fastest runs, a less certain "
                "figure"
            )
        if not self.quiet and self.contended * 2 < self.rounds:  # no other process to blame: the pace moved
            return (
                f"no quiet rounds: the plans' pace moved from round to round ({what}); each plan was timed by its "
                "fastest runs, a less certain figure"
            )
        if not self.quiet:
            return (
                f"the machine was too busy to measure ({what}); each plan was timed by its fastest runs, "
                "a less certain figure"
            )
        return f"the machine was busy ({what}); timings extended to {self.counted} quiet rounds"

    def to_dict(self) -> dict[str, float | int | str | bool | None]:
        """A JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Busy:
        """The inverse of ``to_dict``."""
        return cls(**data)

    @classmethod
    def merged(cls, measurements: Sequence[Busy | None]) -> Busy | None:
        """One figure for several measurements of a command or run: rounds summed, shares weighted by rounds."""
        known = [busy for busy in measurements if busy is not None]
        if not known:
            return None
        rounds = sum(busy.rounds for busy in known)

        def weighted(name: str) -> float | None:
            readable = [busy for busy in known if getattr(busy, name) is not None]
            if not readable:
                return None
            total = sum(busy.rounds for busy in readable)
            return sum(getattr(busy, name) * busy.rounds for busy in readable) / max(1, total)

        return cls(
            rounds,
            sum(busy.counted for busy in known),
            sum(busy.contended for busy in known),
            weighted("others"),
            weighted("waited"),
            known[0].cpus,
            all(busy.quiet for busy in known),
            max((busy.slower_by for busy in known if busy.slower_by is not None), default=None),
        )
