"""Why training turned NaN: which gradients, which op, which layer, which line, why.

* :func:`diagnose` (the NaN doctor) takes a model and data as ``fit`` does, finds the
  first batch whose loss or gradients are not finite, and returns a
  :class:`Diagnosis`: the phase, the op (and, for a gradient op, the forward op it
  differentiates), the layer, the line of user code, the variables, what the op's
  inputs were, the cause (one of ``CAUSES``), its fix and the book section.
* :class:`NaNDoctor` is the same for ``model.fit`` users, as a callback, and
  :func:`diagnose_function` for a custom training step (eager, ``tf.function``, XLA).
* :func:`nonfinite_gradients` says *which variables* receive NaN or Inf gradients on
  one batch.
* :func:`locate_nonfinite` says *where* the first non-finite value of any function is
  produced, op by op.
* :meth:`Diagnosis.save` writes the failing step to one file (a NaN capsule) and
  :func:`replay` re-runs it on an edited model or step: is it finite now?
* ``python -m companion.diagnostics script.py [args]`` runs an unmodified training
  script with a :class:`NaNDoctor` on every ``fit`` (and ``train``) it calls.

The package, one idea per module: ``gradients`` (per-variable records), ``sources``
(which stack frames are the user's, which layer is running), ``trace``
(the op-by-op re-run and the map from gradient ops to forward ops), ``locate``,
``causes`` (the documented causes and how one is recognised), ``data`` (data as
``fit`` takes it), ``scan`` (the scanning step: each batch's loss and gradients as
``fit`` computes them, with nothing updated), ``diagnosis`` (:class:`Diagnosis`, and
how one is made from the op that turned non-finite), ``doctor`` (:func:`diagnose`:
the scan, then the checks and the op-by-op re-run of the failing batch), ``function``
(:func:`diagnose_function`), ``report`` (text and HTML), ``callback``
(:class:`NaNDoctor`), ``state`` (every replica's copy of a variable, saved and
restored, so the doctor changes nothing), ``hooks`` (the diagnosis of the first
step :func:`companion.training.train` skips, under any strategy and on every worker),
``step`` (a model's own ``train_step`` as the doctor runs it, and which non-finite op
is the culprit), ``remedies`` (a remedy for the case, applied to a copy of the failing step and
verified: a clamp on the user's line, a layer's float32 policy, the batch without its
NaN rows, a label fix), ``optimizer_remedies`` (a smaller or a positive learning rate,
``clipnorm`` or a fixed schedule, re-run over ``fit``'s steps; the causes read from the
run), ``pipeline`` (where an input pipeline's map made a NaN: its op and line),
``update`` (a NaN written by the update, not by the gradient), ``initial`` (weights not
finite before any step: which layer, which variable, what set them),
``rewrites`` (the remedy written against the user's line, and the clamp that applies it
to the calls from that line for a re-run), ``line_rewrite`` (a remedy that rewrites the
user's statement, applied for one re-run), ``user_line`` (how the user's line spells an
op, and what its names are),
``capsule_file`` (the failing step as one file, written by :meth:`Diagnosis.save`),
``capsule`` (:func:`replay`) and ``__main__``
(``python -m companion.diagnostics``).
"""

from __future__ import annotations

from companion.diagnostics.capsule import Replayed, replay
from companion.diagnostics.causes import CAUSES, Cause
from companion.diagnostics.diagnosis import Diagnosis
from companion.diagnostics.doctor import diagnose
from companion.diagnostics.function import diagnose_function
from companion.diagnostics.gradients import GradientRecord, GradientReport, nonfinite_gradients
from companion.diagnostics.locate import NonFiniteLocation, locate_nonfinite

#: Every cause a :class:`Diagnosis` names, mapped to its :class:`Cause` (description,
#: fix, book section); the API page's table lists them. New causes are added, none is
#: renamed. (Re-bound here so that the API page documents it.)
#:
#: :meta hide-value:
CAUSES = CAUSES

__all__ = [
    "CAUSES",
    "Cause",
    "Diagnosis",
    "diagnose",
    "diagnose_function",
    "GradientRecord",
    "GradientReport",
    "NaNDoctor",
    "NonFiniteLocation",
    "locate_nonfinite",
    "nonfinite_gradients",
    "Replayed",
    "replay",
]


def __getattr__(name: str):
    """:class:`NaNDoctor`, imported when first asked for: it runs ``fit``'s steps through
    :mod:`companion.training`'s guarded step, and ``companion.training`` imports this
    package's types (an import at the top would be a circle)."""
    if name == "NaNDoctor":
        from companion.diagnostics.callback import NaNDoctor

        return NaNDoctor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "NaNDoctor"})
