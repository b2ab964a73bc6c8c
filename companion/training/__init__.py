"""A training loop that survives NaN: :func:`train`, and what it returns and raises.

:func:`train` is Keras' ``fit`` with a guarded step: inside the compiled step it checks
that the loss, every gradient and everything the step wrote are finite, whatever the
model's ``train_step`` (Keras' own or an override with optimizers of its own); a step
that fails the check changes no variable and is recorded in the :class:`TrainingHistory`. :class:`SkipNonFinite`
(from :mod:`companion.optimizers`) gives ``model.fit`` users the same skip.

The package, one idea per module:

* ``results``: :class:`TrainingHistory`, :class:`SkippedStep`, :class:`Rollback`,
  :class:`NonFiniteError`, :class:`WorkerLostError`.
* ``inputs``: the checks of :func:`train`'s own arguments.
* ``step``: the guarded ``train_step`` installed in ``fit`` (``GuardedStep``);
  ``interception``: the optimizer calls it intercepts (``scale_loss``, ``apply``) and the
  update it runs for them; ``holdings``: the optimizers and the random state a model
  holds; ``values``: its raw reads and finiteness tests; ``buffer``: its records on the
  device, drained by the host; ``spikes``: ``skip_loss_spikes``' running statistics and
  test.
* ``deferred``: the model optimizer's update run at the step's end, under one predicate,
  with no copy of the weights or the optimizer's state; ``bounds``: the proof, from
  running bounds, that an update of Keras' SGD, Adam, AdamW or Lion is finite.
* ``masking``: every variable write of an update traced as a select (used by
  ``benchmarks/conditional_update.py``; the masked step selects at the step's end).
* ``records``: the step's records read on the host, the error, the doctor's view;
  ``callbacks``: the guard's and the checkpoint's callbacks; ``patches``: everything
  :func:`train` changes on a model, and how it is put back.
* ``checkpoints``: epoch-end checkpoints and resuming.
* ``recovery``: ``on_nonfinite="rollback"``: the snapshot, the rollback with a smaller
  learning rate (:class:`ScaledSchedule` for a schedule), the causes no rate cures.
* ``cluster``: the workers of a multi-worker run.
* ``loop``: :func:`train` itself (install the guard, ``fit``, clean up);
  ``preparation``: what it does before ``fit`` (check, compile, build, resume).

The chapter *A training loop that survives NaN* derives the design and measures its cost.
"""

from __future__ import annotations

from companion.optimizers import SkipNonFinite
from companion.training.loop import train
from companion.training.recovery import ScaledSchedule
from companion.training.results import NonFiniteError, Rollback, SkippedStep, TrainingHistory, WorkerLostError

__all__ = [
    "NonFiniteError", "Rollback", "ScaledSchedule", "SkipNonFinite", "SkippedStep", "TrainingHistory",
    "WorkerLostError", "train",
]
