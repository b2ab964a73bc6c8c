"""The masked update: an optimizer step that is applied or not, without a conditional.

While ``optimizer.apply`` is traced under :class:`masked_writes`, every variable write
becomes ``assign(where(apply, new, old))``. When ``apply`` is false every variable is
written its own old value, bit for bit; when it is true the update is the one the
optimizer asked for. Under XLA the select fuses into the optimizer's element-wise
update, so a guarded step reads and writes each parameter and slot once, as an
unguarded step does; a conditional update instead makes XLA copy every variable and
slot (chapter *A training loop that survives NaN*, section on cost).
"""

from __future__ import annotations

import tensorflow as tf

from companion import _internal


class UnmaskableUpdate(Exception):
    """The optimizer's update wrote state in a way :class:`masked_writes` cannot mask."""


#: Stateful ops an update traced under ``masked_writes`` may contain: reads, and the
#: masked assignments the context emits itself (each one counted). Anything else, a
#: variable created during the update included, makes the loop use a conditional update.
MASKABLE_STATEFUL_OPS = frozenset({"ReadVariableOp", "AssignVariableOp"})


class masked_writes:
    """Trace-time context: every resource-variable write becomes ``where(apply, new, old)``.

    On exit, the ops traced inside the context are checked: any stateful op other than
    reads and the masked assignments themselves (a scatter, a fused ``ResourceApply*``
    kernel, a nested conditional or function call, a random-number generator) raises
    :class:`UnmaskableUpdate`, and the caller falls back to a conditional update.

    Args:
        apply: a boolean scalar tensor: whether the writes take effect.
    """

    def __init__(self, apply: tf.Tensor) -> None:
        self.apply = apply
        self.count = 0
        self._intercept = None

    def _rewrite(self, old: tf.Tensor, new: tf.Tensor) -> tf.Tensor:
        self.count += 1
        return tf.where(self.apply, new, old)

    def __enter__(self) -> "masked_writes":
        if not _internal.variable_writes_interceptable():
            raise UnmaskableUpdate("variable writes cannot be intercepted with this TensorFlow")
        self._graph = tf.compat.v1.get_default_graph()
        self._first_op = len(self._graph.get_operations())
        self._intercept = _internal.intercept_variable_writes(self._rewrite)
        self._intercept.__enter__()
        return self

    def __exit__(self, kind, error, trace) -> None:
        self._intercept.__exit__(kind, error, trace)
        if kind is not None:
            return
        traced = self._graph.get_operations()[self._first_op :]
        stateful = [op for op in traced if op.op_def is not None and op.op_def.is_stateful]
        foreign = sorted({op.type for op in stateful if op.type not in MASKABLE_STATEFUL_OPS})
        assigns = sum(op.type == "AssignVariableOp" for op in stateful)
        if foreign:
            raise UnmaskableUpdate(f"the update contains {', '.join(foreign)}")
        if assigns != self.count:
            # Writes that did not go through the interceptor: TensorFlow or Keras no
            # longer write variables the way companion._internal relies on.
            _internal.warn_once(
                "unintercepted writes",
                f"{assigns - self.count} of {assigns} variable writes of the update bypassed "
                "gen_resource_variable_ops: the masked update is unavailable, so the update runs under a tf.cond "
                "(same results, slower with XLA)",
            )
            raise UnmaskableUpdate("the update contains unmasked assignments")
