"""A training loop that survives NaN: :func:`train`, and what it returns and raises.

:func:`train` is Keras' ``fit`` with a guarded step: inside the compiled step it checks
that the loss, every gradient and everything the step wrote are finite, whatever the
model's ``train_step`` (Keras' own or an override with optimizers of its own); a step
that fails the check changes no variable and is recorded in the :class:`TrainingHistory`. :class:`SkipNonFinite`
(from :mod:`companion.optimizers`) gives ``model.fit`` users the same skip.

The package, one idea per module:

* ``results``: :class:`TrainingHistory`, :class:`SkippedStep`, :class:`NonFiniteError`,
  :class:`WorkerLostError`.
* ``inputs``: the checks of :func:`train`'s own arguments.
* ``masking``: every variable write of an update traced as a select (used by
  ``benchmarks/conditional_update.py``; the guard selects at the step's end).
* ``guard``: the guarded ``train_step`` installed in ``fit``, and the callback that
  reads its records after every host call.
* ``checkpoints``: epoch-end checkpoints and resuming.
* ``cluster``: the workers of a multi-worker run.
* ``loop``: :func:`train` itself (compile, install the guard, ``fit``, clean up).

The chapter *A training loop that survives NaN* derives the design and measures its cost.
"""

from __future__ import annotations

from companion.optimizers import SkipNonFinite
from companion.training.loop import train
from companion.training.results import NonFiniteError, SkippedStep, TrainingHistory, WorkerLostError

__all__ = ["NonFiniteError", "SkipNonFinite", "SkippedStep", "TrainingHistory", "WorkerLostError", "train"]
