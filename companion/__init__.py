"""companion: the production code of the book *NaN gradients in TensorFlow*.

Importing :mod:`companion` is cheap: it does not import TensorFlow. The submodules
load on first use, so ``companion.notebook.setup()`` can quiet TensorFlow's C++ logging
before TensorFlow itself is imported.

Submodules:
    numerics: numerically safe tensor functions (e.g. :func:`companion.numerics.double_where`).
    notebook: one-call set-up for the book's chapters.
    training: :func:`companion.training.train`, a training loop that survives NaN.
    optimizers: :class:`companion.optimizers.SkipNonFinite`, the same skip for ``model.fit``.
    losses: losses resolved as ``compile`` does, with the shape checks that are right for them.
    launch: start the workers of a multi-worker job on one machine (``python -m companion.launch``).
    diagnostics: which gradients are non-finite, and where the first NaN appears.
    attention: scaled dot-product attention and the attention block of ParameterNet.
    models: :class:`companion.models.ParameterNet`, case A's model with switchable fixes.
    targets: the families of target functions g(x) that ParameterNet fits.
    reproductions: the seeds' failing code, faithfully, so chapters and tests can show it.
    runs: short instrumented training runs (first non-finite step, learning-rate sweeps).
    accuracy: errors in ulp against an mpmath reference (needs mpmath).
    benchmark_results: the measured cost of the fixes, shipped with the package.
"""

from __future__ import annotations

import importlib
from typing import Any

from companion._version import __version__

_SUBMODULES = (
    "accuracy",
    "attention",
    "benchmark_results",
    "checklist",
    "diagnostics",
    "launch",
    "losses",
    "models",
    "notebook",
    "numerics",
    "optimizers",
    "reports",
    "reproductions",
    "runs",
    "targets",
    "training",
)

__all__ = ["__version__", *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"companion.{name}")
    raise AttributeError(f"module 'companion' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
