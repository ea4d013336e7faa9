"""Trials in a child process: a crash or a hang there is a failed trial, never a dead run."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import multiprocessing
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.backends.base import DEVICE_OWNER_ENV
from autotune.config.schema import TuneConfig
from autotune.extras import MissingExtra
from autotune.harness.deadline import layerwise_allowance_s
from autotune.harness.prepare import LayerwiseBounds, SetupError, measure_forms
from autotune.harness.runner import TrialRunner
from autotune.harness.stderr import StderrRelay
from autotune.measure.timing import Protocol
from autotune.plan import Plan

GO = ("go", None)
"""The run's go-ahead to a trial process started with it (``ChildRunner.launch(gated=True)``)."""
LOG_FORMAT = "autotune: %(message)s"
"""How the command and its trial process print progress notes (model export, calibration time) to stderr."""


def _die_with_parent() -> None:
    """Makes the trial process end with the run, even when the run is killed with SIGKILL.

    On Linux the kernel sends this process SIGKILL when the thread that started it exits (``PR_SET_PDEATHSIG``),
    so a killed run leaves no orphan building or hanging on a shared machine. Elsewhere the process still ends
    at its next request, when it reads the end of the pipe.
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # no libc symbol: keep the end-of-pipe behaviour
            return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # the parent died before prctl took effect
        os._exit(1)


def handle(runner: TrialRunner, kind: str, payload: Any) -> tuple[str, Any]:
    """Answers one request of the run with a ``TrialRunner``: ``("result", data)`` or ``("error", traceback)``.

    The protocol every worker speaks, in a child process (``ChildRunner``) or a Ray actor (``harness.executor``).
    """
    try:
        if kind == "trial":
            plan, split, protocol, *sequential = payload  # the search's trials add True: ``TrialRunner.run``
            result = runner.run(Plan.from_dict(plan), split, Protocol(**protocol) if protocol else None, *sequential)
            return "result", result.to_dict()
        if kind == "side_by_side":
            plans, split, protocol = payload
            results = runner.run_side_by_side(
                [Plan.from_dict(plan) for plan in plans], split, Protocol(**protocol) if protocol else None
            )
            return "result", [result.to_dict() for result in results]
        if kind == "layerwise":
            choices = runner.layerwise
            if choices is None:
                return "result", None
            return "result", {"methods": choices.methods, "errors": choices.errors, "forms": forms_of(runner)}
        if kind == "fp32_plan":
            return "result", runner.fp32_plan.to_dict()
        if kind == "references":
            return "result", list(runner.backend.references())
        if kind == "int8_arithmetic":
            return "result", runner.backend.int8_arithmetic()
        if kind == "export":
            plan, out_dir = payload
            return "result", runner.export(Plan.from_dict(plan), Path(out_dir))
        return "error", f"unknown request {kind!r}"
    except Exception:  # noqa: BLE001
        return "error", traceback.format_exc()


CODE_CHANGED = (
    "autotune's source files changed on disk while this run was going (an upgrade or an edit), or a Ray node has "
    "another install, so a new trial process would run other code than the run; nothing measured is lost: make "
    "every node's install the same and continue with `autotune resume RUN_DIR`"
)


def forms_of(runner: TrialRunner) -> dict[str, dict[str, float]]:
    """Per INT8 form besides the default scheme, each layer's single-layer error (``prepare.measure_forms``).

    Measured at the first request and kept: the priors of a run ask once.
    """
    if getattr(runner, "_forms", None) is None:
        runner._forms = measure_forms(  # type: ignore[attr-defined]
            LayerwiseBounds(runner.config.cache_dir, layerwise_allowance_s(runner.config.budget.minutes)),
            runner.model,
            runner.backend,
            runner.space,
            runner.calibration,
            runner._calibration_data,
            runner.output_index,
            runner.layerwise,
        )
    return runner._forms  # type: ignore[attr-defined]


def fingerprint(root: Path) -> str:
    """A hash of the Python files under ``root``: their paths relative to it and their contents."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def source_fingerprint() -> str:
    """The fingerprint of the autotune package as this process first saw it on disk.

    Why: trial processes are spawned, so each one imports autotune from disk afresh; one spawned after an upgrade
    or an edit (a restart after a crash, a worker of a later batch) would run other code than the run, and answer
    in a format the run may misread. The run sends its fingerprint; a trial process whose own differs refuses.
    """
    return fingerprint(Path(__file__).resolve().parent.parent)


def prepare_runner(
    config_data: dict, source: str | None = None, gate: Callable[[], None] | None = None
) -> tuple[TrialRunner | None, tuple[str, Any]]:
    """Prepares a ``TrialRunner``; returns it and ``("ready", stages)``, or None and ``("setup_error", message)``.

    ``stages`` is the runner's ``setup_stages_s``: where its set-up went, for the run's summary.

    Args:
        config_data: The run's config.
        source: The run's :func:`source_fingerprint`; a different one here refuses with :data:`CODE_CHANGED`.
        gate: ``TrialRunner``'s: where a trial process started with the run waits for the run's go-ahead.
    """
    if source is not None and source != source_fingerprint():
        return None, ("setup_error", CODE_CHANGED)
    try:
        runner = TrialRunner(TuneConfig.model_validate(config_data), gate)
        return runner, ("ready", dict(runner.setup_stages_s))
    except Exception as error:  # noqa: BLE001 - reported to the parent, which raises it
        # A user can act on these from their message alone; anything else is a bug, and its traceback says where.
        known = isinstance(error, SetupError | MissingExtra)
        return None, ("setup_error", f"{error}" if known else traceback.format_exc())


def place_worker(cores: list[int] | None, environment: dict[str, str] | None) -> None:
    """Pins this process to its cores and sets its environment (``CUDA_VISIBLE_DEVICES``) before any backend loads.

    Why by hand: neither ONNX Runtime nor multiprocessing places a process; the kernel's affinity mask is the
    one knob, and ``intra_op_threads`` threads then share exactly these cores with no other worker.
    """
    os.environ.update(environment or {})
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)


def _worker_main(
    connection: Any,
    config_data: dict,
    log_level: int = logging.WARNING,
    cores: list[int] | None = None,
    environment: dict[str, str] | None = None,
    source: str | None = None,
    gated: bool = False,
    stderr: Any = None,
) -> None:
    """Serves trials until the parent closes the pipe.

    ``gated``: started with the run (``ChildRunner.launch``), the process loads the backend, then waits for the
    run's ``GO`` before it reads the model the run is still exporting. ``stderr``: the pipe the process's file
    descriptor 2 is moved to (the run's ``StderrRelay`` reads it), so a runtime's last words name its crash.

    Ctrl-C in a terminal, and SIGTERM from ``timeout`` or a scheduler, reach the whole process group: the trial
    process ignores both and leaves the interrupt to the run, which stops it after committing what was measured
    (a trial process that died of the signal would be recorded as a crashed trial of the plan it was building).
    """
    if stderr is not None:
        os.dup2(stderr.fileno(), 2)  # C++ runtimes write there too, not only sys.stderr
        stderr.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)  # a spawned process starts without the run's logging
    _die_with_parent()
    place_worker(cores, environment)
    os.environ[DEVICE_OWNER_ENV] = "1"  # this process builds and times: it may start CUDA itself

    def wait_for_the_run() -> None:
        message = connection.recv()  # EOFError: the run stopped before it needed us
        if message != GO:
            raise SetupError(f"the trial process expected the run's go-ahead, got {message!r}")

    runner, reply = prepare_runner(config_data, source, wait_for_the_run if gated else None)
    while True:
        try:
            connection.send(reply)
        except OSError:  # the run closed the pipe (it was stopped or interrupted): nobody waits for the answer
            return
        if runner is None:
            return
        try:
            kind, payload = connection.recv()
        except (EOFError, OSError):  # closed, or reset by the run with our answer unread
            return
        reply = handle(runner, kind, payload)


class ChildRunner:
    """A ``TrialRunner`` in a child process, restarted after a crash or a timeout.

    Args:
        config: The run's config: the whole of it travels to the child process, which prepares the run from it.
        setup_timeout_s: How long preparing the run may take; default twice ``backend.timeout_s``, at least 600 s.
        cores: CPUs the process is pinned to (None: not pinned).
        environment: Environment variables of the process, e.g. ``CUDA_VISIBLE_DEVICES``.
    """

    def __init__(  # takes the whole config: it ships it to the child process (a process boundary)
        self,
        config: TuneConfig,
        setup_timeout_s: float | None = None,
        cores: list[int] | None = None,
        environment: dict[str, str] | None = None,
    ):
        self.config = config
        self.setup_timeout_s = setup_timeout_s or max(600.0, 2 * config.backend.timeout_s)
        self.cores = cores
        self.environment = environment
        self._context = multiprocessing.get_context("spawn")
        self.source = source_fingerprint()  # what every (re)started trial process must run
        self._process: Any = None
        self._connection: Any = None
        self._gated = False
        self._stderr: StderrRelay | None = None
        self.setup_stages_s: dict[str, float] = {}
        """Where the last (re)start's set-up went in the process (``TrialRunner.setup_stages_s``)."""

    def start(self) -> None:
        """Starts the child process and waits until it has prepared the run.

        Raises:
            SetupError: Preparing failed, died or took longer than the setup timeout.
        """
        self.launch()
        self.await_ready()

    def launch(self, gated: bool = False) -> None:
        """Starts the child process without waiting for it to prepare (``await_ready`` waits).

        Args:
            gated: The process loads the backend (imports its runtime, probes its device), then waits for
                ``release`` before it reads the model: started with the run, it does that while the run analyses
                and exports the model (torch and CUDA took 7-10 s of the trial process's set-up on the H200).
        """
        self._gated = gated
        parent, child = self._context.Pipe()
        stderr_reader, stderr_writer = self._context.Pipe(duplex=False)
        self._process = self._context.Process(
            target=_worker_main,
            args=(
                child,
                self.config.model_dump(mode="json"),
                logging.getLogger().getEffectiveLevel(),
                self.cores,
                self.environment,
                self.source,
                gated,
                stderr_writer,
            ),
            daemon=True,
        )
        self._process.start()
        child.close()
        stderr_writer.close()
        self._stderr = StderrRelay(os.dup(stderr_reader.fileno()))
        stderr_reader.close()
        self._connection = parent

    def await_ready(self) -> None:
        """Waits until the launched process has prepared the run.

        Raises:
            SetupError: Preparing failed, died or took longer than the setup timeout.
        """
        self.release()
        parent = self._connection
        if not parent.poll(self.setup_timeout_s):
            self.stop()
            raise SetupError(f"preparing the run took longer than {self.setup_timeout_s:.0f} s")
        try:
            kind, message = parent.recv()
        except EOFError:
            death = self._death()
            self.stop()
            raise SetupError(f"the trial process died while preparing the run {death}") from None
        if kind != "ready":
            self.stop()
            raise SetupError(message)
        self._stderr.flush()
        self.setup_stages_s = dict(message or {})

    def release(self) -> None:
        """Lets a gated process go on to prepare the run; nothing for one that is not gated, or was let go."""
        if self._gated:
            self._gated = False
            try:
                self._connection.send(GO)
            except OSError:  # it ended before the go-ahead (its set-up failed): ``await_ready`` reads its answer
                pass

    def _death(self) -> str:
        """How the process died, for its error: ``(exit code -6, SIGABRT): <its last line on stderr>``."""
        self._process.join(timeout=5)  # reap it, so the exit code is known
        code = self._process.exitcode
        name = f", {signal.Signals(-code).name}" if code is not None and -code in signal.valid_signals() else ""
        last = self._stderr.last_line() if self._stderr is not None else None
        return f"(exit code {code}{name})" + (f": {last}" if last else "")

    def stop(self) -> None:
        """Kills the child process."""
        if self._process is not None:
            if self._connection is not None:
                self._connection.close()
            self._process.join(timeout=2)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        self._process = None
        self._connection = None

    @property
    def connection(self) -> Any:
        """The pipe to the process (for ``multiprocessing.connection.wait``), None while it is stopped."""
        return self._connection

    @property
    def pid(self) -> int | None:
        """The process id, None while it is stopped."""
        return self._process.pid if self._process is not None else None

    def send(self, kind: str, payload: Any) -> None:
        """Sends one request without waiting, starting the process first if it is not running.

        Raises:
            SetupError: A restarted process could not prepare the run.
        """
        if self._process is None or not self._process.is_alive():
            self.start()
        self._stderr.mark()
        self._connection.send((kind, payload))

    def receive(self, wait_s: float, timeout_s: float) -> tuple[str, Any]:
        """The answer to the request sent last; after ``wait_s`` without one, the process is killed (a timeout).

        Args:
            wait_s: How long to wait now.
            timeout_s: The request's whole time limit, for the message.
        """
        if not self._connection.poll(wait_s):
            self._process.kill()
            self.stop()
            return "timeout", f"no result after {timeout_s:.0f} s; the trial process was killed"
        try:
            answer = self._connection.recv()
        except EOFError:
            death = self._death()
            self.stop()
            return "crash", f"the trial process died {death}"
        self._stderr.flush()
        return answer

    def request(self, kind: str, payload: Any, timeout_s: float) -> tuple[str, Any]:
        """Sends one request; returns ``(status, payload)`` with status result, error, crash or timeout."""
        self.send(kind, payload)
        return self.receive(timeout_s, timeout_s)
