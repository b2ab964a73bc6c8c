"""Everything :func:`companion.training.train` changes on a model, recorded and put back.

``train`` runs Keras' own ``fit``. For the duration of the call it changes what the table
below lists, each through one :class:`ModelPatches`, which records the value it replaces
the first time and puts every one back when the call ends, whether it returns or raises:
afterwards a plain ``model.fit`` runs Keras' own step (``tests/contracts`` checks the
model's attributes before and after). When Keras changes, this is the list to read.

================  ==================================  =============================================
object            attribute                           why
================  ==================================  =============================================
model             ``train_step``                      the guarded step, which runs the model's own
                                                      (:class:`~companion.training.step.GuardedStep`)
model             ``test_step``                       multi-worker only: logs with a leading axis
                                                      for fit's ``strategy.reduce(..., axis=0)``
model             ``_maybe_symbolic_build``           multi-worker only: the symbolic build from the
                                                      local replica's batch (set and removed by
                                                      :mod:`companion._internal.keras_trainer`)
model             ``train_function``,                 fit's compiled step functions: the guarded one
                  ``test_function``                   an earlier call of ``train`` traced (kept for
                                                      the next call), else ``None`` so that fit traces
                                                      the guarded step; the user's are put back
model.optimizer   ``scale_loss``, ``apply``           the loss noted, the update guarded
other optimizers  ``apply``                           the gradients noted (a GAN's second optimizer)
model             ``steps_per_execution``             several steps per host call, when ``train``
                                                      chooses it
model             ``jit_compile``                     off under several replicas (Keras' XLA step
                                                      fails there)
================  ==================================  =============================================

Two changes outlive the call, on purpose: when XLA cannot compile the model's step,
``train`` warns, trains without it, and leaves ``jit_compile`` off (the next call would
fail to compile it again); and a rollback of ``on_nonfinite="rollback"`` leaves every
optimizer's learning rate reduced (a schedule wrapped in
:class:`~companion.training.ScaledSchedule`), as the run's history and checkpoints
record it.

Put back means: an attribute the object had of its own gets its value again; one it
did not have (a method of its class) is removed, so the class's applies again; a
property is set to the value it had.

Two changes last only while a step is traced, as context managers that undo themselves:
the optimizer's ``_all_reduce_sum_gradients`` (the gradients are summed once,
:func:`companion._internal.optimizer_all_reduce_skipped`) and TensorFlow's
resource-variable write ops (the masked update,
:func:`companion._internal.intercept_variable_writes`). While the NaN doctor re-runs a
skipped step, the model's own ``train_step`` and ``test_step`` come back
(:meth:`GuardedStep.unguarded_steps <companion.training.step.GuardedStep.unguarded_steps>`).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from companion import _internal

_OWN, _PROPERTY, _NONE = "own", "property", "none"


class ModelPatches:
    """Attributes set on a model and its optimizers for one call of ``train``, put back by :meth:`restore`."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, str, Any]] = []
        self._before_restore: list[Callable[[], None]] = []
        self._undo: list[Callable[[], None]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        """``owner.<name> = value``, remembering (the first time) what to put back."""
        if not any(o is owner and n == name for o, n, _, _ in self._saved):
            if name in vars(owner):
                self._saved.append((owner, name, _OWN, vars(owner)[name]))
            elif isinstance(getattr(type(owner), name, None), property):
                self._saved.append((owner, name, _PROPERTY, getattr(owner, name)))
            else:
                self._saved.append((owner, name, _NONE, None))
        setattr(owner, name, value)

    def set_step_functions(self, model, train_function, test_function) -> None:
        """Put these in the attributes where fit keeps its compiled step functions."""
        present = _internal.step_function_attributes(model)
        for name, value in zip(_internal.STEP_FUNCTION_ATTRIBUTES, (train_function, test_function)):
            if name in present:
                self.set(model, name, value)

    def repair_symbolic_build(self, model) -> None:
        """The multi-worker repair of fit's symbolic build, undone by :meth:`restore`."""
        _internal.repair_symbolic_build_for_multi_worker(model)
        self._undo.append(lambda: _internal.undo_symbolic_build_repair(model))

    def before_restore(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` first thing in :meth:`restore` (to keep what the call made), once."""
        if callback not in self._before_restore:
            self._before_restore.append(callback)

    def changed(self) -> list[tuple[Any, str]]:
        """The (object, attribute) pairs set so far, in order."""
        return [(owner, name) for owner, name, _, _ in self._saved]

    def restore(self) -> None:
        """Put back every attribute set, the last first; safe to call twice."""
        while self._before_restore:
            self._before_restore.pop(0)()
        while self._undo:
            self._undo.pop()()
        while self._saved:
            owner, name, kind, value = self._saved.pop()
            if kind == _NONE:
                if name in vars(owner):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)


#: Patches a callback installed for the length of a ``fit`` call (the NaN doctor's guard),
#: per model: ``fit`` calls no callback when it raises, so the next ``fit`` of the model
#: through the doctor, or the next :func:`~companion.training.train`, puts them back first.
_LEFT: "weakref.WeakKeyDictionary[Any, ModelPatches]" = weakref.WeakKeyDictionary()


def hold_until_fit_ends(model, patches: ModelPatches) -> None:
    """Remember ``patches`` as installed on ``model`` for one ``fit`` call."""
    _LEFT[model] = patches
    patches.before_restore(lambda: _LEFT.pop(model, None))


def restore_leftover(model) -> bool:
    """Put back the patches a ``fit`` that raised left on ``model``; whether there were any."""
    try:
        patches = _LEFT.pop(model, None)
    except TypeError:  # pragma: no cover - not weak-referenceable
        return False
    if patches is None:
        return False
    patches.restore()
    return True
