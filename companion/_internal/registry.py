"""The registry of hooks on private TensorFlow/Keras APIs, and their warning.

Every function of :mod:`companion._internal` that relies on a private TensorFlow or Keras
API is registered with :func:`hook`, naming its canary tests: tests that fail loudly when
an upgrade of TensorFlow or Keras removes what the hook relies on or stops calling it. A
plain name is a test of ``tests/contracts/test_tf_internals.py``; ``path::name`` names a
test elsewhere. ``tests/contracts/test_tf_internals.py`` checks the registry: every public
function of the family modules is a hook, and every hook has a canary that exists.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


class InternalAPIWarning(RuntimeWarning):
    """A private TensorFlow/Keras API that :mod:`companion` relies on is gone or changed.

    The package still works, through a fall-back that the warning names; report it so
    the hook can be updated.
    """


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str) -> None:
    """Issue ``message`` as an :class:`InternalAPIWarning`, once per process and ``key``."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, InternalAPIWarning, stacklevel=3)


@dataclasses.dataclass(frozen=True)
class Hook:
    """A registered hook: its module, its name and the tests that watch what it relies on."""

    module: str
    name: str
    canaries: tuple[str, ...]


#: Every hook, by ``module.name``.
HOOKS: dict[str, Hook] = {}


def hook(*canaries: str) -> Callable[[F], F]:
    """Register the decorated function as a hook on a private API, watched by ``canaries``."""

    def register(function: F) -> F:
        entry = Hook(function.__module__, function.__name__, tuple(canaries))
        HOOKS[f"{entry.module}.{entry.name}"] = entry
        return function

    return register
