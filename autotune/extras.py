"""Optional dependencies: imported where they are used, with a one-line install hint when they are missing.

The heavy optional parts of autotune (the MiniLM example, the Optuna baseline, TensorRT, Ray) are extras of the
package, installed with ``pip install 'autotune[NAME]'``. A feature that needs one imports it through
:func:`require`, whose :class:`MissingExtra` the CLI prints as one line (exit code 2) instead of a traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


class MissingExtra(ImportError):
    """An optional dependency is not installed; the one-line message names the extra that installs it."""


def require(module: str, extra: str, what: str, hint: str = "") -> ModuleType:
    """Imports ``module``, an optional dependency that the extra ``extra`` installs.

    Args:
        module: The module to import, e.g. ``"optuna"``.
        extra: The extra of autotune that installs it, e.g. ``"optuna"``.
        what: The feature that needs it, for the message, e.g. ``"the optuna strategy"``.
        hint: Another way to get the feature, appended to the message in parentheses; one line.

    Returns:
        The imported module.

    Raises:
        MissingExtra: The module (or a package it imports) is not installed.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        raise _missing(module, extra, what, hint) from error


def check_installed(module: str, extra: str, what: str, hint: str = "") -> None:
    """Checks that ``module``'s top-level package is installed, without importing it.

    For a process that only validates a config: importing torchao alone takes 10 s on a cold machine, and the
    process that builds imports it again (through :func:`require`, which also catches a broken install).

    Raises:
        MissingExtra: As :func:`require`.
    """
    if importlib.util.find_spec(module.partition(".")[0]) is None:
        raise _missing(module, extra, what, hint)


def _missing(module: str, extra: str, what: str, hint: str) -> MissingExtra:
    message = f"{what} needs the '{extra}' extra: pip install 'autotune[{extra}]'"
    return MissingExtra(f"{message} ({hint})" if hint else message, name=module)
