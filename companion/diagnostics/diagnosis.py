"""What the NaN doctor says: the :class:`Diagnosis`, and how one is made from an op.

A :class:`Diagnosis` names the phase, the op, the layer, the line, the cause (one of
``CAUSES``), its fix, its section and the remedy the doctor verified;
:func:`from_event` makes one from the first non-finite op of an op-by-op re-run
(:class:`~companion.diagnostics.trace.OpTracer`), naming the cause from what that op's
inputs were. :func:`keep_state` attaches the failing step (what
:meth:`Diagnosis.save` writes), and :func:`replace` keeps it through a change.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from companion.diagnostics import report
from companion.diagnostics.capsule_file import save as save_capsule
from companion.diagnostics.causes import CAUSES, classify, grew
from companion.diagnostics.locate import dtype_name
from companion.diagnostics.sources import source_text
from companion.diagnostics.trace import nonfinite_mask

__all__ = ["Diagnosis", "PHASES", "from_event", "keep_state", "replace", "symptom"]

PHASES = ("input", "weights", "forward", "loss", "backward", "update")


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """What made a batch's loss or gradients non-finite, and what to do about it.

    Attributes:
        batch: index (0-based) of the batch, counted from the start of ``data``.
        phase: where the first non-finite value appeared: ``"input"`` (the batch),
            ``"weights"`` (the model), ``"forward"`` (the model's call), ``"loss"``
            (the loss and regularisation), ``"backward"`` (the gradient) or ``"update"``
            (what the optimizer or a layer's moving statistic would write, from a finite
            loss and finite gradients).
        op: type of the op whose output was first non-finite (``"Log"``,
            ``"SqrtGrad"``); for the update phase, the optimizer's apply
            (``"Adam.apply"``); ``None`` for the input and weights phases.
        forward_op: for a gradient op, the forward op it differentiates; else ``None``.
        layer: path of the Keras layer (for a gradient op, the forward op's layer).
        source: ``"file:line"`` of the user's code that created the op (for a
            gradient op, the line that created the forward op).
        variables: paths of the variables with non-finite gradients.
        dtype: dtype of the first non-finite tensor.
        inputs_summary: what the culprit's inputs were, e.g. ``"3 of 64 inputs of
            Sqrt are exactly 0"``.
        cause: one of the names of ``CAUSES``.
        fix: what to do (the cause's fix).
        section: the book chapter and anchor that shows the cause.
        mode_disagreement: ``None``, or a sentence saying that the compiled step and
            the op-by-op re-run disagree, and which of them is non-finite.
        symptom: ``"non-finite loss"`` or ``"finite loss, non-finite gradients"``
            (in the mode that found the batch).
        code: the text of the ``source`` line.
        worker: in a multi-worker :func:`companion.training.train` run, the index of
            the worker whose shard made the NaN; else ``None``.
        epoch: the epoch (0-based) of the ``fit`` or ``train`` step, when the doctor ran
            inside one (``batch`` is then counted within that epoch); else ``None``.
        remedy: the first remedy for this case, from the op and its context: the call
            or statement to write instead on the user's line (a clamp of the op's
            input, a double ``where``, ``softplus``), a float16 layer's float32 policy,
            the batch without its NaN rows, labels shifted or weighted out, a
            learning-rate schedule fixed, or for a divergence the optimizer with a
            learning rate ten times smaller or else with ``clipnorm=1.0``: of the
            remedies the doctor has for the case, the first that verifies; ``None``
            if none.
        verified: what the doctor found when it applied that remedy to a copy of the
            failing step, or of the steps up to it (``companion.diagnostics.remedies``
            says how, for each kind): ``"verified: the step is finite with ..."`` or
            ``"not verified: ..."`` and why (also when the doctor could not apply it:
            a choice for a library function's input); ``None`` when there is no
            remedy.

    A diagnosis made by :func:`diagnose` (and so by :class:`NaNDoctor` and ``train``)
    also keeps the failing step's state in memory: :meth:`save` writes it to a file
    that :func:`~companion.diagnostics.replay` re-runs.
    """

    batch: int | None
    phase: str
    op: str | None
    forward_op: str | None
    layer: str | None
    source: str | None
    variables: tuple[str, ...]
    dtype: str | None
    inputs_summary: str
    cause: str
    fix: str
    section: str
    mode_disagreement: str | None = None
    symptom: str = ""
    code: str | None = None
    worker: int | None = None
    epoch: int | None = None
    remedy: str | None = None
    verified: str | None = None

    def save(self, path: str | os.PathLike) -> str:
        """Write the failing step to one ``.npz`` file: a NaN capsule.

        The file holds the failing batch, every variable of the model and of its
        optimizers as they were before the step (by path), the states of the global
        random generators, and this diagnosis as JSON; no pickled object, so
        ``np.load(path, allow_pickle=False)`` reads it. Attach it to a bug report, or
        check a fix with :func:`~companion.diagnostics.replay`.

        Args:
            path: the file to write (``.npz`` is appended by NumPy if missing).

        Returns:
            The path written.

        Raises:
            ValueError: if this diagnosis keeps no state (one made by
                :meth:`from_dict`, or by :func:`diagnose_function` on a function
                without tensor arguments).
        """
        return save_capsule(self, path)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict (the training checkpoint stores it)."""
        return {**dataclasses.asdict(self), "variables": list(self.variables)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Diagnosis":
        """Inverse of :meth:`to_dict`."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in data.items() if k in names}, "variables": tuple(data["variables"])})

    @property
    def description(self) -> str:
        """The cause's description (from ``CAUSES``)."""
        return CAUSES[self.cause].description

    def __str__(self) -> str:
        return report.text(self)

    def _repr_html_(self) -> str:
        return report.html(self)



def keep_state(diagnosis: "Diagnosis", state: dict | None) -> "Diagnosis":
    """Attach the failing step's state (for :meth:`Diagnosis.save`) to ``diagnosis``."""
    if diagnosis is not None and state is not None:
        object.__setattr__(diagnosis, "_capsule", state)
    return diagnosis


def replace(diagnosis: "Diagnosis", **changes) -> "Diagnosis":
    """``dataclasses.replace`` that keeps the failing step's state."""
    return keep_state(dataclasses.replace(diagnosis, **changes), getattr(diagnosis, "_capsule", None))



def symptom(compiled: dict) -> str:
    """What the scanning step saw: ``"non-finite loss"``, ``"finite loss, non-finite gradients"``, ..."""
    if compiled.get("own"):
        if compiled.get("logs"):
            return "non-finite " + ", ".join(compiled["logs"])
        return "finite logs, non-finite values written"
    if compiled.get("loss"):
        return "non-finite loss"
    return "finite loss, non-finite gradients"




def from_event(event, tracer, index, variables, disagreement, loss_finite, losses_before) -> Diagnosis:
    """The diagnosis of a traced op ``event``: its op, layer, line, inputs and cause."""
    name, summary = classify(event, tracer.masked_selects, loss_finite=loss_finite)
    if name in ("overflow", "inf_arithmetic", "unclassified") and grew(list(losses_before)):
        name = "divergence"
    record = event.record
    where = event.forward if event.backward and event.forward is not None else record
    phase = "backward" if event.backward else record.stage
    if phase not in PHASES:
        phase = "forward"
    value = next(o for o in event.outputs if o is not None and o.size and nonfinite_mask(o).any())
    cause = CAUSES[name]
    fix = cause.fix
    if name == "where_trap" and tracer.masked_selects:
        select = tracer.masked_selects[0]
        if select.filename:
            fix += f" (the tf.where at {os.path.basename(select.filename)}:{select.lineno})"
    return Diagnosis(
        batch=index,
        phase=phase,
        op=record.op_type,
        forward_op=event.forward_type,
        layer=where.layer,
        source=f"{where.filename}:{where.lineno}" if where.filename else None,
        variables=tuple(variables),
        dtype=dtype_name(value),
        inputs_summary=summary,
        cause=name,
        fix=fix,
        section=cause.section,
        mode_disagreement=disagreement,
        symptom=symptom({"loss": not loss_finite}),
        code=source_text(where.filename, where.lineno),
    )
