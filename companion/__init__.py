"""companion: the production code of the book *NaN gradients in TensorFlow*.

Importing :mod:`companion` is cheap: it does not import TensorFlow. The submodules
load on first use, so ``companion.book.notebook.setup()`` can quiet TensorFlow's C++
logging before TensorFlow itself is imported.

What a project imports:
    numerics: numerically safe tensor functions (:func:`companion.numerics.double_where`,
        ``safe_pow``, ``log_exp_power``, the Taylor/asymptotic ``f``).
    losses: losses resolved as ``compile`` does, with the shape checks that are right for them.
    attention: scaled dot-product attention that stays finite, and ParameterNet's attention block.
    training: :func:`companion.training.train`, Keras' ``fit`` with a guarded step that
        survives NaN.
    optimizers: :class:`companion.optimizers.SkipNonFinite`, the same skip for ``model.fit``.
    diagnostics: the NaN doctor (``diagnose``): which op, layer, line and cause made the
        first NaN, and the remedy that cures it.
    launch: start the workers of a multi-worker job on one machine (``python -m companion.launch``).

The book's own support code is :mod:`companion.book` (chapter set-up and tables, the seeds'
code, ParameterNet and its targets, the runs, the survey and its cases, the rebuilt
reports, ulp accuracy, benchmark results): it serves the chapters and carries no stability
promise. The library never imports it. Its modules' old top-level names
(``companion.notebook``, ``companion.checklist``, ...) still work for one release, with a
``DeprecationWarning``.
"""

from __future__ import annotations

import importlib
from typing import Any

from companion._moved import MOVED
from companion._version import __version__

#: What a user imports, and the book's support package.
_SUBMODULES = (
    "attention",
    "book",
    "diagnostics",
    "launch",
    "losses",
    "numerics",
    "optimizers",
    "training",
)

#: Old names of modules that moved to companion.book: they warn (companion._moved).
_MOVED = frozenset(name.removeprefix("companion.") for name in MOVED)

__all__ = ["__version__", *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES or name in _MOVED:
        return importlib.import_module(f"companion.{name}")
    raise AttributeError(f"module 'companion' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
