import os
import signal

import pytest

from autotune.interrupt import Terminated, interrupts_held, sigterm_interrupts


def test_sigterm_raises_terminated_inside_the_block_and_the_old_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated), sigterm_interrupts():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0)  # let the handler run before the block ends
    assert signal.getsignal(signal.SIGTERM) is before


def test_terminated_is_an_interrupt():
    assert issubclass(Terminated, KeyboardInterrupt)  # every Ctrl-C path (commit the time, save the agent) takes it


def test_held_sigterm_waits_for_the_block_then_raises():
    finished = []
    with pytest.raises(Terminated), sigterm_interrupts():
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGTERM)
            finished.append(True)
    assert finished == [True]


def test_held_ctrl_c_waits_for_the_block_then_raises_keyboard_interrupt():
    finished = []
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt) as raised, interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            finished.append(True)
        assert not isinstance(raised.value, Terminated)
        assert finished == [True]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_outside_the_cli_sigterm_is_left_to_its_own_handler():
    before = signal.getsignal(signal.SIGTERM)
    with interrupts_held():
        assert signal.getsignal(signal.SIGTERM) is before  # a library call does not take over the process's SIGTERM
