"""A remedy chosen from the op and its context, applied to a copy of the failing step, and checked.

The fix in :data:`~companion.diagnostics.CAUSES` is the cause's; the remedy here is the
case's, where it is mechanical and can be tried on the failing step itself:

* an overflow in a layer that computes in float16 or bfloat16 (a mixed-precision
  policy): that layer's policy to float32 (``dtype="float32"``, the layer's variables
  are float32 already), the cure Keras' mixed-precision guide gives, not the cause's
  generic list; for a layer of the user's own with sublayers, ``dtype="float32"`` for
  each layer it creates as well (they take the global policy, not their parent's);
* a NaN or Inf in the batch: where a ``tf.data`` map made it, the clamp on that map's
  line (:mod:`.pipeline` checks it on the elements the map made non-finite), else the
  step without the rows that hold it (clean or drop them in the input pipeline);
* values that grew over the previous steps (``divergence``): the optimizer as compiled
  with a learning rate ten times smaller, or else with ``clipnorm=1.0`` (written as the
  call to make): the first of the two that verifies;
* a learning rate at or below 0, or a schedule that explodes or keeps rising
  (``learning_rate``, read by :func:`~companion.diagnostics.optimizer_remedies.from_the_run`
  from the schedule's rates up to the failing step): the schedule fixed (a Keras schedule's argument, or the ``return``
  line of the user's own schedule clipped into the rates it gave before), else
  ``clipnorm=1.0``; never a rate ten times smaller, which a negative rate keeps;
* targets as large as the model's own outputs on the same inputs
  (``bootstrapped_targets``): ``clipnorm=1.0``;
* a label outside the logits' classes (``label_out_of_range``): the labels shifted to
  start at 0 where they are a block of as many labels as classes, else the labels
  outside weighted 0;
* anything else: :func:`~companion.diagnostics.rewrites.choose` writes the call to write instead on the user's own line,
  from the op (for a gradient op, the forward op), the cause, and the line's text and
  the two after it (where the op's input came from: a norm in a denominator, an
  ``exp`` that a sum divides, a ``-inf`` mask); where the line does not spell the op
  (it is inside a TensorFlow or Keras function the user cannot edit) the remedy says
  so and clamps that function's input instead.

:func:`verify` applies the remedy to a copy of the failing step and says
``"verified: the step is finite with ..."`` or ``"not verified: ..."`` (why), and every
variable, the layer's policy, the optimizer's learning rate and ``clipnorm`` and every
patched function are put back afterwards, also when the re-run fails. What is verified:

* the float32 policy and the dropped rows: the failing step re-run once with them
  (the policy set on the layer and on every layer nested in it, as the printed
  remedy makes them, and every layer's policy put back);
* a smaller learning rate, ``clipnorm`` and a fixed schedule (:mod:`.optimizer_remedies`): the
  training steps re-run with them
  (``model.train_step``, eagerly) from the earliest state the doctor has: under
  :class:`~companion.diagnostics.NaNDoctor`, the start of ``fit`` (or of the epoch,
  when ``fit`` shuffled the rows and only this epoch's batches are known), every
  step up to the failing one; under :func:`~companion.diagnostics.diagnose` alone,
  the failing step from the weights before it (the report says which). First without
  the remedy, as a control that must fail as ``fit`` did; the remedy verifies if every
  step is then finite and no logged value grows step after step. Not under a
  distribution strategy of several replicas (an update outside it would wait for the
  other replicas): "not verified", and why;
* a clamp written on the user's line (``tf.sqrt(tf.maximum(x, eps))``, the clamped
  ``log``, ``lgamma``, ``rsqrt``, ``acos``/``asin`` input, ``exp(minimum(x, limit))``,
  ``atan2``/``angle`` moved off the origin, ``divide_no_nan``, ``safe_pow``/``signed_pow``,
  a norm's clamped square): the failing step re-run eagerly with the function the line
  spells (for ``x / y``, the tensor's division operator) replaced, only for calls
  made from that file and line, by the form the remedy prints (in
  :func:`~companion.diagnostics.diagnose_function`, the function called again, unless
  it wrote a variable);
* ``jit_compile=False`` for a step that only XLA makes non-finite: the step re-run
  compiled without XLA.

* a rewritten statement (a double ``where``, ``log(1 + exp(x))`` as ``softplus``,
  ``exp(x) / reduce_sum(exp(x))`` as ``softmax``, ``x / norm(x)`` as ``l2_normalize``, a
  finite mask instead of ``-inf``): the failing step re-run eagerly with the code of the
  function that holds the line compiled again from its source with that statement
  rewritten as printed (:class:`~companion.diagnostics.line_rewrite.LineRewrite`), and put
  back afterwards.

Where a case has several remedies (:func:`candidates`), each is checked in turn and the
first that verifies is printed first; where none does, the first is printed with what
every check found. A remedy the doctor cannot apply (a choice for a library function's
input), or a clamp whose call the re-run never made from that line, is printed with
:data:`UNCHECKED` (nothing was run with it). A failure of the check itself is a ``"not
verified: ..."`` sentence, never an exception.
"""

from __future__ import annotations

from typing import Any

import contextlib
import os

import keras
import numpy as np
import tensorflow as tf

from companion import _internal
from companion.diagnostics.data import nonfinite_data
from companion.diagnostics.gradients import _variable_path
from companion.diagnostics.sources import layer_path
from companion.diagnostics.state import restore, snapshot
from companion.diagnostics.rewrites import Clamp, choice, choose, verify_clamp
from companion.diagnostics.diagnosis import replace
from companion.diagnostics.optimizer_remedies import (
    Steps, from_the_run, rate_candidates, replicas, smaller_learning_rate, verify_divergence,
)
from companion.diagnostics.scan import compiled_step, run_scan_step
from companion.diagnostics.step import OwnStepScan
from companion.diagnostics.trace import nonfinite_mask

__all__ = ["Steps", "choose", "verify"]

LOW_PRECISION = ("float16", "bfloat16")

#: Causes whose remedies are checked by re-running training steps (NaNDoctor hands them over).
STEP_CAUSES = frozenset({"divergence", "learning_rate", "bootstrapped_targets"})


def _layer(model, path: str | None):
    if not path:
        return None
    for layer in _internal.all_layers(model)[1:]:  # every nested layer, not the model
        if layer_path(layer) == path:
            return layer
    return None


def _finite_step(model, loss_fn, x, y, w, eager: bool = False, graph: bool = False) -> bool:
    """Whether one scanning step on this batch is finite; changes nothing.

    Eagerly for a compiled model's loss (and for a model's own ``train_step`` if
    ``eager``: a patched call is then seen from the user's own line): a check of one
    batch needs no trace, and a new ``tf.function`` per check would count as retracing
    the doctor's scanning step. ``graph``: a ``tf.function`` without XLA, for both.
    """
    own = loss_fn is None
    if graph:
        step = OwnStepScan(model, False) if own else compiled_step(model, loss_fn, False)
    else:
        step = OwnStepScan(model, None if eager else False) if own else compiled_step(model, loss_fn, None)
    ok, bad, _ = run_scan_step(model, step, own, x, y, w)
    return ok and not bad


def _rows(batch) -> np.ndarray | None:
    """Indices of the rows (first axis) of a batch that hold a non-finite value."""
    bad = set()
    for _, array in nonfinite_data(batch):
        if array.ndim == 0:
            return None
        mask = nonfinite_mask(array).reshape(array.shape[0], -1).any(axis=1)
        bad.update(int(i) for i in np.nonzero(mask)[0])
    return np.array(sorted(bad), dtype=np.int64)


def _without(part, keep):
    if part is None:
        return None
    return tf.nest.map_structure(lambda v: tf.gather(tf.convert_to_tensor(v), keep), part)


def verify(diagnosis: Any, model: Any, loss_fn: Any, x, y, w, steps: "Steps | None" = None) -> Any:
    """``diagnosis`` with ``remedy`` and ``verified`` set, where a mechanical remedy applies.

    ``steps`` (from :class:`~companion.diagnostics.NaNDoctor`) are the training steps
    from the earliest state the doctor kept to the failing one, for a remedy of a
    divergence; without them the failing step alone is re-run. Never raises: a failure
    of the check is a ``"not verified: ..."`` sentence.
    """
    if diagnosis is None or not isinstance(model, keras.Model):
        return diagnosis
    try:
        diagnosis = from_the_run(diagnosis, model, x, y)
    except Exception:  # noqa: BLE001 - the doctor never raises into fit: the cause stays as it was
        pass
    try:
        found = _verify(diagnosis, model, loss_fn, x, y, w, steps)
    except Exception as error:  # the doctor's own failure: said, not raised
        remedy = None
        try:
            layer = _layer(model, diagnosis.layer) if diagnosis.dtype in LOW_PRECISION else None
            if diagnosis.cause in ("overflow", "divergence") and layer is not None:
                remedy = _float32_remedy(diagnosis.layer, layer)[0]
            elif diagnosis.cause == "divergence":
                remedy = smaller_learning_rate(model)[0]
            else:
                remedy = choose(diagnosis)
        except Exception:  # noqa: BLE001 - the doctor never raises into fit
            pass
        found = (remedy, f"not verified: the re-run with the remedy failed ({type(error).__name__}: {error})"[:300])
    if found is None:
        remedy = choose(diagnosis)
        if remedy is None or diagnosis.remedy:
            return diagnosis
        found = (remedy, None)
    remedy, verified = found
    if remedy is not None and verified is None:
        verified = UNCHECKED
    return replace(diagnosis, remedy=remedy if remedy is not None else diagnosis.remedy, verified=verified)


#: What the report says of a remedy printed with no check (every printed remedy says what was run).
UNCHECKED = ("not verified: the doctor could not apply this remedy to a copy of the step (a choice it cannot "
             "make for you, or a call the re-run did not make from that line): nothing was run with it")


def _verify(d, model, loss_fn, x, y, w, steps=None):
    """The remedy printed first and its check: the first candidate that verifies, else the first candidate."""
    found = candidates(d, model, loss_fn, x, y, w, steps, every=False)
    if not found:
        return None
    return next(((r, v) for r, v in found if (v or "").startswith("verified")), found[0])


def candidates(d, model, loss_fn, x, y, w, steps=None, *, every: bool = True) -> list[tuple[str, "str | None"]]:
    """The remedies for diagnosis ``d`` in the doctor's order, each with what its check found.

    ``every=False`` stops at the first that verifies (what :func:`verify` prints first);
    ``every=True`` checks them all (a test of the rule that an unverified remedy is
    never printed first where a verified one exists). A remedy with no mechanical
    check has ``None``.
    """
    found = []
    for remedy, check in _candidates(d, model, loss_fn, x, y, w, steps):
        verdict = check() if check is not None else None
        found.append((remedy, verdict))
        if not every and (verdict or "").startswith("verified"):
            break
    return found


def _one(found):
    """A single ``(remedy, verdict)`` as a candidate list (checked already)."""
    return [] if found is None else [(found[0], (lambda v=found[1]: v))]


def _candidates(d, model, loss_fn, x, y, w, steps=None):
    """``[(remedy, check)]``: each remedy the doctor may print first, in order, with its check (or ``None``)."""
    if d.cause == "label_out_of_range":
        return _label_candidates(d, model, loss_fn, x, y, w)
    if d.cause in ("learning_rate", "bootstrapped_targets"):
        return rate_candidates(d, model, x, y, w, steps)
    if d.cause == "divergence" and not d.dtype in LOW_PRECISION:
        return [(r, (lambda v=v: v)) for r, v in verify_divergence(d, model, x, y, w, steps, every=True)]
    return _one(_verify_single(d, model, loss_fn, x, y, w, steps))


def _verify_single(d, model, loss_fn, x, y, w, steps=None):
    if d.cause in ("overflow", "divergence") and d.dtype in LOW_PRECISION:
        layer = _layer(model, d.layer)
        if layer is None:
            return None
        remedy, what = _float32_remedy(d.layer, layer)
        with _float32(layer):
            finite = _finite_step(model, loss_fn, x, y, w)
        return remedy, (f"verified: the step is finite with {what}" if finite
                        else f"not verified: the step is still non-finite with {what}")
    if d.cause == "compiled_only" and getattr(model, "jit_compile", False):
        finite = _finite_step(model, loss_fn, x, y, w, graph=True)
        return choose(d), ("verified: the step is finite with jit_compile=False (the same step compiled "
                           "without XLA)" if finite else
                           "not verified: the step compiled without XLA (jit_compile=False) is still non-finite")
    if d.cause == "nonfinite_init":
        return _verify_initial(d, model, loss_fn, x, y, w)
    if d.cause == "nonfinite_input":
        rows = _rows((x, y, w))
        if rows is None or not len(rows):
            return None
        size = int(np.shape(tf.nest.flatten(x)[0])[0])
        keep = np.array([i for i in range(size) if i not in set(rows.tolist())], dtype=np.int64)
        shown = ", ".join(str(r) for r in rows[:5]) + (", ..." if len(rows) > 5 else "")
        label = f"row{'s' if len(rows) > 1 else ''} {shown}"
        remedy = f"drop or impute {label} of the batch in the input pipeline (e.g. dataset.filter on tf.math.is_finite)"
        if not len(keep):
            if d.remedy and (d.verified or "").startswith("verified"):  # the map's line, checked by .pipeline
                return d.remedy, d.verified
            return remedy, "not verified: every row of the batch holds a non-finite value"
        finite = _finite_step(model, loss_fn, _without(x, keep), _without(y, keep), _without(w, keep))
        if d.remedy and (d.verified or "").startswith("verified") and finite:
            # the clamp on the pipeline's own line first: the map's values are finite with it
            return d.remedy, f"{d.verified}; and the failing step is finite without {label}"
        return remedy, (f"verified: the step is finite without {label}" if finite
                        else f"not verified: the step is still non-finite without {label}")
    remedy, clamp = choice(d)
    if remedy is None or clamp is None:
        return None
    return remedy, _verify_clamp(d, clamp, model, loss_fn, x, y, w)


def _verify_clamp(d, clamp: Clamp, model, loss_fn, x, y, w) -> str | None:
    """The failing step re-run with the clamp on the user's line; ``None`` if it could not be applied."""
    if loss_fn is None and replicas(model) > 1:  # an own train_step's update would wait for the other replicas
        return None
    return verify_clamp(d, clamp, lambda: _finite_step(model, loss_fn, x, y, w, eager=True))


def _nested_low_precision(layer) -> list:
    """The layers nested in ``layer`` (not ``layer`` itself) that compute in float16 or bfloat16."""
    return [inner for inner in _internal.all_layers(layer)[1:]
            if getattr(inner, "compute_dtype", None) in LOW_PRECISION]


def _float32_remedy(path: str, layer) -> tuple[str, str]:
    """The float32 policy for ``layer`` and every layer nested in it, as the call to write, and what is checked.

    A layer's dtype policy is its own: the sublayers it creates in ``__init__`` take the
    global policy (``mixed_float16``) unless they are given one, so a block whose
    ``Conv`` or ``Dense`` sublayer computes in float16 still hands float16 values to its
    own ops. Keras' own composite layers (``MultiHeadAttention``, ...) pass their
    ``dtype`` on to the sublayers they make; a user's layer, or a nested model, must be
    given it for each.
    """
    name = type(layer).__name__
    nested = _nested_low_precision(layer)
    remedy = f"compute {path} in float32: {name}(..., dtype=\"float32\")"
    what = f"{path}'s dtype policy float32"
    own_class = not type(layer).__module__.startswith("keras.") or isinstance(layer, keras.Model)
    if nested and own_class:  # a user's layer, or a Sequential/functional model of separately made layers
        paths = [layer_path(inner) for inner in nested]
        shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
        remedy += (f", and dtype=\"float32\" for each layer it creates ({shown}: under the mixed policy they "
                   "compute in float16 inside it otherwise)")
        what += f" and that of the {len(nested)} layer{'s' if len(nested) > 1 else ''} nested in it ({shown})"
    elif nested:
        what += f" (passed on to the {len(nested)} layer{'s' if len(nested) > 1 else ''} nested in it)"
    return remedy + " (its variables are float32 already)", what


@contextlib.contextmanager
def _float32(layer):
    """``layer`` and every layer nested in it computing in float32; every policy put back afterwards."""
    layers = _internal.all_layers(layer)
    before = [(inner, inner.dtype_policy) for inner in layers]
    try:
        for inner in layers:
            inner.dtype_policy = "float32"
        yield
    finally:
        for inner, policy in before:
            inner.dtype_policy = policy


def _verify_initial(d, model, loss_fn, x, y, w):
    """A weight non-finite before any step: its non-finite entries set to 0, and the step re-run."""
    bad = [v for v in model.variables if _variable_path(v) in set(d.variables)]
    if not bad:
        return None
    at = f"at {os.path.basename(d.source.rpartition(':')[0])}:{d.source.rpartition(':')[2]}: " if d.source else ""
    names = ", ".join(_variable_path(v) for v in bad)
    remedy = (f"{at}set {names} finite where it is set: value -> np.nan_to_num(value, nan=0.0, posinf=0.0, "
              "neginf=0.0) (a class with a prior of 0 gets a bias of 0, a spread of 0 a scale of 0)")
    saved = snapshot(bad)
    try:
        for variable in bad:
            value = np.asarray(variable.numpy())
            variable.assign(np.nan_to_num(value, nan=0.0, posinf=0.0, neginf=0.0).astype(value.dtype))
        finite = _finite_step(model, loss_fn, x, y, w)
    finally:
        restore(saved)
    what = f"the non-finite entries of {names} set to 0"
    return remedy, (f"verified: the step is finite with {what}" if finite
                    else f"not verified: the step is still non-finite with {what}")


# --------------------------------------------------------------------------------------
# Labels outside [0, classes)
# --------------------------------------------------------------------------------------


def _label_values(d, y):
    """The batch's labels as integers, and the number of classes the op's summary names."""
    import re  # noqa: PLC0415

    found = re.search(r"outside \[0, (\d+)\)", d.inputs_summary or "")
    if found is None or y is None or isinstance(y, (dict, list, tuple)):
        return None, None
    labels = np.asarray(y)
    if labels.dtype.kind == "f" and not np.all(labels == np.round(labels)):
        return None, None
    return labels.astype(np.int64), int(found.group(1))


def _label_candidates(d, model, loss_fn, x, y, w):
    """Labels that start at another value than 0: shifted; else the ones outside masked with a weight of 0."""
    labels, classes = _label_values(d, y)
    if labels is None:
        return []
    found = []
    low, high = int(labels.min()), int(labels.max())
    dtype = np.asarray(y).dtype
    if low != 0 and high - low < classes:  # a block of `classes` labels that starts at `low`
        shift = f"y - {low}" if low > 0 else f"y + {-low}"
        shifted = (labels - low).astype(dtype)
        found.append((f"labels from 0: {shift} in the input pipeline (the labels run from {low} to {high}; the "
                      f"output has {classes} classes, 0 to {classes - 1})",
                      lambda: _label_check(model, loss_fn, x, shifted, w, f"the labels {shift}")))
    valid = (labels >= 0) & (labels < classes)
    weight = valid.astype(np.float32) if w is None else (np.asarray(w) * valid).astype(np.asarray(w).dtype)
    masked = np.where(valid, labels, 0).astype(dtype)
    found.append((f"labels to ignore get a sample weight of 0 (and label 0): w = tf.cast((y >= 0) & (y < {classes}), "
                  f"tf.float32){' * w' if w is not None else ''}; y = tf.where(w > 0, y, 0) (the output has "
                  f"{classes} classes; {int((~valid).sum())} labels of the batch are outside [0, {classes}), "
                  f"or give the output {high + 1} units if they are classes)",
                  lambda: _label_check(model, loss_fn, x, masked, weight,
                                       f"the {int((~valid).sum())} labels outside [0, {classes}) weighted 0")))
    return found


def _label_check(model, loss_fn, x, y, w, what: str) -> str:
    finite = _finite_step(model, loss_fn, x, y, w)
    return (f"verified: the step is finite with {what}" if finite
            else f"not verified: the step is still non-finite with {what}")
