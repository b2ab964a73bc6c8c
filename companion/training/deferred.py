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
the steps that take it.

Deferring is exact only if the step does not look at what the update wrote: it must not
read the model's weights or the optimizer's state after calling ``apply``, nor write
them itself, nor call ``apply`` twice. :func:`writes_of_step` checks the traced step;
a step that does any of these raises :class:`Undeferrable` while it is traced, and
:func:`companion.training.train` traces it again with the masked step.
"""

from __future__ import annotations

import tensorflow as tf

from companion import _internal
from companion._gradients import one_update_at_a_time
from companion.training.values import SELECT_LIMIT, all_finite, entries, read



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

    def run(self, finite, direct, on_skip=None) -> tf.Tensor:
        """The update, if ``finite``: proved finite, or tested on a copy and put back if it
        is not. Returns whether it was applied; ``on_skip()`` is traced into the branches
        that apply nothing (the NaN/Inf counts of a large model).

        The optimizer's update is traced once (its trace is the costly part of a first
        call): a copy of what it writes is made before it only where the proof failed
        (elsewhere that conditional returns empty tensors), and the test and put-back
        after it run only there too.
        """
        bound = self.step.bound
        proved, advance = bound.prove(self.gradient_bound, self.step.inner.learning_rate)
        tested = tf.logical_and(finite, tf.logical_not(proved))

        def copy():
            return [tf.identity(read(v)) for v in direct]

        def no_copy():
            return [tf.zeros([0], v.dtype) for v in direct]

        saved = tf.cond(tested, copy, no_copy) if direct else []

        def update():
            self._update()
            return tf.constant(True)

        def skip():
            if on_skip is not None:
                on_skip()
            return tf.constant(False)

        with tf.control_dependencies(saved):
            applied = tf.cond(finite, update, skip)

        def proved_path():
            advance()
            return applied

        def test():
            now = [read(v) for v in direct]
            ok = all_finite(now, flatten=entries(now) <= SELECT_LIMIT)

            def put_back():
                for variable, value in zip(direct, saved):
                    tf.raw_ops.AssignVariableOp(resource=variable.handle, value=value)
                if on_skip is not None:
                    on_skip()
                return tf.constant(0)

            tf.cond(ok, lambda: tf.constant(0), put_back)
            bound.remeasure()
            return ok

        with tf.control_dependencies([applied]):
            return tf.cond(tested, test, lambda: tf.cond(applied, proved_path, lambda: applied))
