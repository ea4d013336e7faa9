"""Stopping a run from outside: Ctrl-C and SIGTERM end it the same way, with every measured trial kept.

A run stopped with Ctrl-C commits its time and its agent's checkpoint on the way out (a KeyboardInterrupt). SIGTERM
is what ``kill``, ``timeout`` and batch schedulers send; by default it ends Python at once, and the run lost the
wall time of the segment it stopped and any checkpoint not yet written. The CLI turns it into :class:`Terminated`,
a KeyboardInterrupt, so it takes the same path.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Terminated", "interrupts_held", "sigterm_interrupts"]

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM
"""The exit status of a command that SIGTERM stopped (a shell's convention: 128 + the signal's number)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread; the old handler comes back after.

    Only the main thread can set a handler: elsewhere the block leaves SIGTERM as it is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Holds Ctrl-C and SIGTERM until the block ends, then raises the interrupt.

    A KeyboardInterrupt inside ``torch.save`` leaves its zip writer half closed, and the writer's exit turns it
    into a RuntimeError: the run would end with a traceback instead of the interrupt's clean exit. SIGTERM is held
    only where it would raise (under :func:`sigterm_interrupts`); elsewhere its handler is left alone.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    held = [signal.SIGINT]
    if signal.getsignal(signal.SIGTERM) is _raise_terminated:
        held.append(signal.SIGTERM)
    previous = {signum: signal.signal(signum, lambda signum, frame: received.append(signum)) for signum in held}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if signal.SIGTERM in received:
        raise Terminated
    if received:
        raise KeyboardInterrupt
