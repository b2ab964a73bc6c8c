"""The deferred update: the model optimizer's update applied at the step's end, under one predicate.

On one replica without a loss scaler, the guarded step does not run the model
optimizer's ``apply`` where the model's ``train_step`` calls it. It notes the gradients
and runs the update after the rest of the step, once everything the step computed and
wrote is known to be finite: ``cond(finite, update, skip)``. A skipped step then never
wrote a weight or a moment, so nothing of them has to be copied to be put back; the
small state the step writes itself (batch-norm statistics, metrics, a variable of a
custom ``train_step``, another optimizer's state) is copied and put back as before.
The cost of the guard is one read of the gradients (their norm, which it needs anyway)
and one of what the step wrote outside the update.

What the update itself writes is the one thing not known before it runs. For Keras'
SGD, Adam, AdamW and Lion it is proved finite from running bounds
(:mod:`companion.training.bounds`); where the proof fails or the optimizer is another,
the update takes the tested path: a copy of what it writes, the update, a test, and a
put-back if it is not finite. That path costs what the masked step costs, and only on
the steps that take it; after it the bounds are unknown until the host measures them
again, after the host call.

Deferring is exact only if the step does not look at what the update wrote: it must not
read the model's weights or the optimizer's state after calling ``apply``, nor write
them itself, nor call ``apply`` twice. :func:`writes_of_step` checks the traced step;
a step that does any of these raises :class:`Undeferrable` while it is traced, and
:func:`companion.training.train` traces it again with the masked step.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from companion import _internal
from companion._gradients import one_update_at_a_time
from companion.training.values import SELECT_LIMIT, entries, entries_finite, read



#: A call of :func:`companion.training.train` defers the update when its steps times the
#: model's trainable entries reach this (or the model is larger than :data:`MASK_UP_TO`);
#: a shorter call on a small model takes the masked step. Measured on a 2-core CPU (the
#: performance page's cold-start and scale runs): the deferred update's conditionals cost
#: a first call about 0.15 s more to trace than the masked step, and the masked step's
#: copy of the weights and the optimizer's state costs each step about 2 ns per trainable
#: entry more (Adam, 0.4 M weights); they break even near 7.5e7 entry-steps.
DEFER_FROM = 2**26

#: From this many trainable entries (4 MiB of float32; the masked step's copy of the
#: weights and Adam's moments 12 MiB) the update is always deferred: there the copy's
#: memory decides, not a first call's time.
MASK_UP_TO = 2**20


def worth_deferring(variables, steps: int | None) -> bool:
    """Whether a call of ``steps`` steps (``None``: not known) on a model with the trainable
    ``variables`` defers its update (see :data:`DEFER_FROM`); a model not built yet (no
    variable known) does."""
    weights = sum(int(np.prod(v.shape)) for v in variables)
    return steps is None or not variables or weights > MASK_UP_TO or weights * steps >= DEFER_FROM


class Undeferrable(Exception):
    """The traced step reads or writes what the deferred update writes (see :func:`writes_of_step`)."""


def writes_of_step(graph, first: int, stop: int, after_apply: int | None, state: list, direct: list) -> set:
    """The ids of the variables of ``state`` that the ops ``first:stop`` of ``graph`` write.

    Raises :class:`Undeferrable` if one of those ops writes a variable of ``direct`` (what
    the deferred update writes), or if one traced after the update's ``apply`` (op index
    ``after_apply``) reads one. Any op that takes a variable's handle and is not a read
    counts as a write: a loop, a conditional or a nested function reads only if nothing
    inside it writes a resource (:func:`companion._internal.functional_op_writes`).
    """
    handles = {}
    for group, variables in (("state", state), ("direct", direct)):
        for v in variables:
            handles[graph.capture(v.handle).ref()] = (group, v)
    written = set()
    for index, op in enumerate(graph.get_operations()[first:stop], start=first):
        for tensor in op.inputs:
            found = handles.get(tensor.ref())
            if found is None:
                continue
            group, variable = found
            reads = op.type in _internal.READ_OPS or _internal.functional_op_writes(op) is False
            if group == "state":
                if not reads:
                    written.add(id(variable))
                continue
            name = getattr(variable, "path", None) or variable.name
            if not reads:
                raise Undeferrable(f"the step writes {name} itself ({op.type})")
            if after_apply is not None and index >= after_apply:
                raise Undeferrable(f"the step reads {name} after the optimizer's apply ({op.type})")
    return written


class DeferredUpdate:
    """The model optimizer's update, noted during the step and run at its end.

    Args:
        step: the :class:`~companion.training.step.GuardedStep`.
        apply: the optimizer's own ``apply``.
        grads: the gradients to apply (clipped if asked).
        variables: the variables they update.
        gradient_bound: a bound of every gradient entry (their global norm).
    """

    def __init__(self, step, apply, grads, variables, gradient_bound) -> None:
        self.step = step
        self.apply = apply
        self.grads = grads
        self.variables = variables
        self.gradient_bound = gradient_bound

    def _update(self) -> None:
        # The update starts after the whole step: its variables one at a time, so that
        # their temporaries are not all alive together (see one_update_at_a_time).
        with one_update_at_a_time(self.step.inner):
            self.step.run_apply(self.apply, self.grads, self.variables)

    def run(self, finite, direct, on_skip=None, on_tested=None) -> tf.Tensor:
        """The update, if ``finite``: proved finite, or tested on a copy and put back if it
        is not. Returns whether it was applied; ``on_skip()`` is traced into the branch
        that applies nothing, ``on_tested()`` into the tested path (the NaN/Inf counts of a
        large model: there the gradients were finite). :attr:`tested` is then whether the
        update took the tested path.

        The optimizer's update is traced once (its trace is the costly part of a first
        call), and the tested path around it is kept small, for it is traced into every
        first call and taken almost never: a copy of what the update writes is made before
        it only where the proof failed (elsewhere that conditional returns empty tensors);
        after it, there only, one test and one select per variable put back a non-finite
        update, and the bounds are set to unknown. The host measures them again after the
        host call (:meth:`GuardedStep.drain`); until then the steps take the tested path.
        """
        bound = self.step.bound
        proved, advance = bound.prove(self.gradient_bound, self.step.inner.learning_rate)
        tested = tf.raw_ops.LogicalAnd(x=finite, y=tf.raw_ops.LogicalNot(x=proved))
        self.tested = tested

        def copy():
            return [tf.raw_ops.Identity(input=read(v)) for v in direct]

        def no_copy():
            return [tf.zeros([0], v.dtype) for v in direct]

        saved = tf.cond(tested, copy, no_copy) if direct else []

        def update():
            self._update()
            advance()  # (a tested update's bounds are then set to unknown)
            return tf.constant(True)

        def skip():
            if on_skip is not None:
                on_skip()
            return tf.constant(False)

        with tf.control_dependencies(saved):
            applied = tf.cond(finite, update, skip)

        def test():
            now = [read(v) for v in direct]
            floats = [value for value in now if value.dtype.is_floating]
            ok = entries_finite(floats, flatten=entries(floats) <= SELECT_LIMIT)
            for variable, new, old in zip(direct, now, saved):
                tf.raw_ops.AssignVariableOp(resource=variable.handle,
                                            value=tf.raw_ops.SelectV2(condition=ok, t=new, e=old))
            if on_tested is not None:
                on_tested()
            bound.forget()
            return ok

        with tf.control_dependencies([applied]):
            return tf.cond(tested, test, lambda: applied)
