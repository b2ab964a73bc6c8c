"""The book's support code: what the chapters of *NaN gradients in TensorFlow* import.

Not part of the library's API and without a stability promise: these modules serve the
chapters (and the tests and benchmarks that check them), and change with the book. The
library (:mod:`companion.numerics`, :mod:`companion.training`, :mod:`companion.diagnostics`,
...) never imports them; ``tests/unit/test_book_package.py`` enforces it.

Its modules:

* ``notebook``: one-call set-up of a chapter (seeds, determinism, quiet logs, plot style)
  and the book's tables (``html_table``);
* ``models``: ``ParameterNet``, case A's model with switchable fixes;
* ``targets``: the families of target functions g(x) that ParameterNet fits;
* ``reproductions``: the seeds' failing code, faithfully, so chapters and tests can show it;
* ``runs``: short instrumented training runs (first non-finite step, learning-rate sweeps);
* ``recovery``: the training-loop chapter's diverging and spiky runs, and their plot;
* ``survey``: the survey of public NaN reports behind the checklist chapter;
* ``cases``: the checklist's cases, one naive computation and its fix per row;
* ``reports``: public NaN reports rebuilt as runnable models, for the doctor's chapter;
* ``debugging``: TensorFlow's and Keras' own NaN tools run on those reports, beside the doctor;
* ``field``: four more rebuilt reports, of the kinds issue 42 added to the doctor;
* ``mechanisms``: the checklist's examples of the mechanisms the survey found recurring;
* ``accuracy``: errors in ulp against an mpmath reference (needs mpmath);
* ``benchmark_results``: the measured cost of the fixes, as the performance chapter shows it;
* ``data``: package data: the survey's CSV and the multi-worker chapter's worker script.
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = (
    "accuracy",
    "benchmark_results",
    "cases",
    "debugging",
    "field",
    "mechanisms",
    "models",
    "notebook",
    "reports",
    "recovery",
    "reproductions",
    "runs",
    "survey",
    "targets",
)

__all__ = list(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"companion.book.{name}")
    raise AttributeError(f"module 'companion.book' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
