"""Trials side by side: a pool of trial workers on this machine, or Ray Core actors on a cluster.

The run (store, search, agent, confirmation) stays in the driver; a worker only prepares the run once (model,
data, calibration, FP32 reference) and answers requests with :func:`autotune.harness.process.handle`. A pool sends
requests to idle workers and hands back the answers in the order they complete. A worker that dies mid-trial is
replaced, and its trial is tried once more on another worker before it is recorded as failed; a trial that runs
past ``backend.timeout_s`` is a timeout (its worker is killed and replaced), as in a run of one worker.

The first worker prepares alone, so it computes and caches the calibration once; the others then start together
and read the cache (a Ray pool ships the first worker's cache files to the others, which may be on other nodes).
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from autotune.backends.base import DEVICE_OWNER_ENV
from autotune.config.schema import ConfigError, TuneConfig
from autotune.extras import require
from autotune.harness.prepare import SetupError
from autotune.harness.process import ChildRunner, handle, prepare_runner, source_fingerprint

log = logging.getLogger(__name__)

Outcome = tuple[str, Any]
"""A worker's answer: ``(status, data)`` with status result, error, crash or timeout."""


def core_groups(workers: int, cores_per_worker: int, available: list[int] | None = None) -> list[list[int]]:
    """Disjoint groups of ``cores_per_worker`` CPUs, one per worker, from the CPUs this process may use.

    Raises:
        ConfigError: The machine has fewer CPUs than the workers need.
    """
    cpus = sorted(available if available is not None else os.sched_getaffinity(0))
    if workers * cores_per_worker > len(cpus):
        raise ConfigError(
            f"execution.workers {workers} x backend.intra_op_threads {cores_per_worker} needs "
            f"{workers * cores_per_worker} CPUs, but this run may use {len(cpus)}: lower one of them"
        )
    return [cpus[i * cores_per_worker : (i + 1) * cores_per_worker] for i in range(workers)]


class Pool(ABC):
    """Workers that answer requests; subclasses say how a worker is started, sent a request and waited for.

    Args:
        size: Number of workers.
        timeout_s: How long one request may take (``backend.timeout_s``).
    """

    def __init__(self, size: int, timeout_s: float):
        self.size = size
        self.timeout_s = timeout_s
        self.replaced = 0  # workers replaced after a crash or a timeout

    @abstractmethod
    def start(self) -> None:
        """Starts every worker; the first prepares alone, so the calibration is computed once."""

    @abstractmethod
    def close(self) -> None:
        """Stops every worker."""

    @abstractmethod
    def send(self, worker: int, kind: str, payload: Any) -> None:
        """Sends one request to a worker, without waiting (a stopped worker is started first)."""

    @abstractmethod
    def collect(self, busy: dict[int, float]) -> list[tuple[int, Outcome]]:
        """Waits until a busy worker answers or passes its deadline (monotonic time); returns what ended."""

    @abstractmethod
    def _abandon(self, worker: int) -> None:
        """Stops a worker whose answer nobody will read (it is started afresh on its next request)."""

    def call(self, kind: str, payload: Any, timeout_s: float | None = None) -> Outcome:
        """One request on the first worker while the others are idle (confirmation, references, export).

        Args:
            kind: The request (``handle`` in :mod:`autotune.harness.process`).
            payload: Its arguments.
            timeout_s: Its time limit, for a request that does the work of several trials (``side_by_side``);
                default ``backend.timeout_s``.
        """
        default = self.timeout_s
        self.timeout_s = timeout_s or default  # the deadline that dispatch and collect give this one request
        try:
            return next(self.map([(kind, payload)]))[1]
        finally:
            self.timeout_s = default

    def map(self, requests: list[tuple[str, Any]]) -> Iterator[tuple[int, Outcome]]:
        """Runs requests on the idle workers; yields ``(index, outcome)`` in the order they complete.

        A crash (the worker died) is retried once on another worker when the pool has more than one.
        """
        queue: deque[tuple[int, str, Any, int | None]] = deque((i, k, p, None) for i, (k, p) in enumerate(requests))
        retried: set[int] = set()
        busy: dict[int, float] = {}
        running: dict[int, tuple[int, str, Any]] = {}
        try:
            while queue or busy:
                self._dispatch(queue, busy, running)
                for worker, outcome in self.collect(busy):
                    del busy[worker]
                    index, kind, payload = running.pop(worker)
                    if outcome[0] == "timeout" or outcome[0] == "crash":
                        self.replaced += 1
                    if outcome[0] == "crash" and self.size > 1 and index not in retried:
                        retried.add(index)
                        log.warning("a trial worker died (%s); trying its trial again on another worker", outcome[1])
                        queue.appendleft((index, kind, payload, worker))
                        continue
                    yield index, outcome
        finally:
            for worker in list(busy):  # closed early or interrupted: no stale answer may reach a later request
                self._abandon(worker)

    def _dispatch(
        self, queue: deque[tuple[int, str, Any, int | None]], busy: dict[int, float], running: dict[int, Any]
    ) -> None:
        """Hands queued requests to idle workers; a retry goes to any worker but the one that died, if it can."""
        waiting: deque[tuple[int, str, Any, int | None]] = deque()
        while queue:
            index, kind, payload, avoid = queue.popleft()
            idle = [w for w in range(self.size) if w not in busy]
            others = [w for w in idle if w != avoid]
            if not idle or (not others and len(busy) > 0):
                waiting.append((index, kind, payload, avoid))  # wait for another worker to come free
                continue
            worker = (others or idle)[0]
            self.send(worker, kind, payload)
            busy[worker] = time.monotonic() + self.timeout_s
            running[worker] = (index, kind, payload)
        queue.extend(waiting)


class LocalPool(Pool):
    """Child processes of the run (``ChildRunner``), each on its own cores or GPU (``make_pool``).

    Args:
        children: One trial process per worker, not started.
        timeout_s: How long one request may take (``backend.timeout_s``).
    """

    def __init__(self, children: list[ChildRunner], timeout_s: float):
        super().__init__(len(children), timeout_s)
        self.children = children

    def start(self) -> None:
        """Starts the first worker, then the others together."""
        self.children[0].start()
        for child in self.children[1:]:
            child.launch()
        for child in self.children[1:]:
            child.await_ready()

    def close(self) -> None:
        """Stops every worker."""
        for child in self.children:
            child.stop()

    def send(self, worker: int, kind: str, payload: Any) -> None:
        """Sends one request to a worker's process (restarted first if it died)."""
        self.children[worker].send(kind, payload)

    def collect(self, busy: dict[int, float]) -> list[tuple[int, Outcome]]:
        """Waits on the busy workers' pipes until one answers or passes its deadline."""
        wait_s = max(0.0, min(busy.values()) - time.monotonic())
        ready = wait([self.children[w].connection for w in busy], timeout=wait_s)
        now = time.monotonic()
        ended = [w for w in busy if self.children[w].connection in ready or busy[w] <= now]
        # receive(0) reads a ready answer, or kills a worker past its deadline and reports the timeout
        return [(w, self.children[w].receive(0.0, self.timeout_s)) for w in ended]

    def _abandon(self, worker: int) -> None:
        self.children[worker].stop()


class RayWorker:
    """A Ray actor holding one prepared ``TrialRunner``: the Ray counterpart of a trial process.

    Args:
        config_data: The run's config, with absolute paths.
        cache_files: The first worker's cache folder (relative path to bytes), written before preparing, so a
            worker on another node does not calibrate again.
        source: The run's source fingerprint: an actor importing other autotune code refuses to serve.

    Ray places the actor (``num_cpus``, ``num_gpus``); unlike a local trial process it is not pinned to cores.
    """

    def __init__(self, config_data: dict, cache_files: dict[str, bytes] | None = None, source: str | None = None):
        if cache_files:
            restore_cache(Path(config_data["cache_dir"]), cache_files)
        self.cache_dir = Path(config_data["cache_dir"])
        os.environ[DEVICE_OWNER_ENV] = "1"  # the actor builds and times: it may start CUDA itself
        self.runner, self.setup = prepare_runner(config_data, source)

    def ready(self) -> Outcome:
        """``("ready", stages)``, or ``("setup_error", message)`` (``prepare_runner``)."""
        return self.setup

    def cache_files(self) -> dict[str, bytes]:
        """The files of the cache folder, for the other workers."""
        return {
            str(path.relative_to(self.cache_dir)): path.read_bytes()
            for path in sorted(self.cache_dir.rglob("*"))
            if path.is_file() and not path.name.startswith(".")
        }

    def serve(self, kind: str, payload: Any) -> Outcome:
        """Answers one request, as a trial process does."""
        if self.runner is None:
            return self.setup
        return handle(self.runner, kind, payload)


def restore_cache(cache_dir: Path, files: dict[str, bytes]) -> None:
    """Writes cache files that are missing here (a worker on the same file system finds them all present)."""
    from autotune.run.files import atomic_write

    for relative, content in files.items():
        path = cache_dir / relative
        if not path.exists():
            atomic_write(path, content)


class RayPool(Pool):
    """Ray Core actors, one per worker, each reserving ``backend.intra_op_threads`` CPUs or one GPU.

    Joins the cluster at ``execution.ray_address`` (or starts a local one) unless Ray is already initialised.
    Every node must be able to import autotune and read the model and data files at the config's paths.

    Args:
        config_data: The run's config as JSON, its folders absolute: it travels to each actor, which prepares the run
            from it.
        size: Number of workers.
        timeout_s: How long one request may take (``backend.timeout_s``).
        cores: CPUs each actor reserves (``backend.intra_op_threads``).
        address: The cluster to join (``execution.ray_address``; None: a local one).
        gpus: One GPU per actor.
    """

    def __init__(
        self, config_data: dict, size: int, timeout_s: float, cores: int, address: str | None, gpus: bool = False
    ):
        super().__init__(size, timeout_s)
        self.ray = require("ray", "ray", "execution.backend: ray")
        if not self.ray.is_initialized():
            self.ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        self._actor_class = self.ray.remote(num_cpus=cores, num_gpus=1 if gpus else 0, max_restarts=0)(RayWorker)
        self._config_data = config_data
        self._source = source_fingerprint()
        self._cache: Any = None
        self.actors: list[Any] = [None] * size
        self._pending: dict[int, Any] = {}

    def _new_actor(self) -> Any:
        return self._actor_class.remote(self._config_data, cache_files=self._cache, source=self._source)

    def _check(self, outcome: Outcome) -> None:
        if outcome[0] == "setup_error":
            raise SetupError(outcome[1])

    def start(self) -> None:
        """Starts the first actor, ships its cache files to the others, and waits until all are prepared."""
        first = self._actor_class.remote(self._config_data, source=self._source)
        self._check(self.ray.get(first.ready.remote()))
        self._cache = self.ray.put(self.ray.get(first.cache_files.remote()))
        self.actors = [first, *(self._new_actor() for _ in range(self.size - 1))]
        for outcome in self.ray.get([actor.ready.remote() for actor in self.actors[1:]]):
            self._check(outcome)

    def close(self) -> None:
        """Kills every actor (the cluster stays up)."""
        for actor in self.actors:
            if actor is not None:
                self.ray.kill(actor)
        self.actors = [None] * self.size

    def send(self, worker: int, kind: str, payload: Any) -> None:
        """Calls the worker's actor (a new one replaces a killed or dead one)."""
        if self.actors[worker] is None:
            self.actors[worker] = self._new_actor()
        self._pending[worker] = self.actors[worker].serve.remote(kind, payload)

    def collect(self, busy: dict[int, float]) -> list[tuple[int, Outcome]]:
        """Waits on the busy actors' calls until one ends or passes its deadline; a dead actor is a crash."""
        wait_s = max(0.0, min(busy.values()) - time.monotonic())
        refs = {self._pending[w]: w for w in busy}
        done, _ = self.ray.wait(list(refs), num_returns=1, timeout=wait_s)
        now = time.monotonic()
        ended: list[tuple[int, Outcome]] = []
        for worker in busy:
            ref = self._pending[worker]
            if ref in done:
                try:
                    outcome = self.ray.get(ref)
                except self.ray.exceptions.RayActorError as error:
                    self._abandon(worker)
                    outcome = ("crash", f"the trial worker died ({type(error).__name__})")
                self._check(outcome)
                ended.append((worker, outcome))
            elif busy[worker] <= now:
                self._abandon(worker)
                ended.append((worker, ("timeout", f"no result after {self.timeout_s:.0f} s; the worker was killed")))
        return ended

    def _abandon(self, worker: int) -> None:
        if self.actors[worker] is not None:
            self.ray.kill(self.actors[worker])
        self.actors[worker] = None
        self._pending.pop(worker, None)


def make_pool(config: TuneConfig) -> Pool:
    """The pool ``execution`` describes (not started).

    Takes the whole config: it ships it to every worker (a child process, a Ray actor), which prepares the run from it.
    """
    execution, backend = config.execution, config.backend
    gpus = execution.gpus_per_worker > 0
    if execution.backend == "ray":
        shipped = config.with_absolute_paths().model_dump(mode="json")  # an actor may run in another folder
        return RayPool(
            shipped, execution.workers, backend.timeout_s, backend.intra_op_threads, execution.ray_address, gpus
        )
    pin = execution.pin_cores if execution.pin_cores is not None else execution.workers > 1
    cores = core_groups(execution.workers, backend.intra_op_threads) if pin and not gpus else [None] * execution.workers
    children = [
        ChildRunner(config, cores=cores[i], environment={"CUDA_VISIBLE_DEVICES": str(i)} if gpus else None)
        for i in range(execution.workers)
    ]
    return LocalPool(children, backend.timeout_s)
