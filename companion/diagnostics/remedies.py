"""A remedy chosen from the op and its context, applied to a copy of the failing step, and checked.

The fix in :data:`~companion.diagnostics.CAUSES` is the cause's; the remedy here is the
case's, where it is mechanical and can be tried on the failing step itself:

* an overflow in a layer that computes in float16 or bfloat16 (a mixed-precision
  policy): that layer's policy to float32 (``dtype="float32"``, the layer's variables
  are float32 already), the cure Keras' mixed-precision guide gives, not the cause's
  generic list;
* a NaN or Inf in the batch: the step without the rows that hold it (clean or drop them
  in the input pipeline).

:func:`verify` applies the remedy to the model for one re-run of the failing step (the
state the doctor saved, every variable restored afterwards, the layer's policy put
back) and says ``"verified: the step is finite with ..."`` or that it is not.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from companion.diagnostics.data import nonfinite_data
from companion.diagnostics.sources import layer_path
from companion.diagnostics.trace import nonfinite_mask

__all__ = ["verify"]

LOW_PRECISION = ("float16", "bfloat16")


def _layer(model, path: str | None):
    if not path:
        return None
    for layer in model._flatten_layers(include_self=False):  # noqa: SLF001 - Keras' own layer walk
        if layer_path(layer) == path:
            return layer
    return None


def _finite_step(model, loss_fn, x, y, w) -> bool:
    """Whether one (graph-mode, no XLA) scanning step on this batch is finite; changes nothing."""
    from companion.diagnostics.doctor import _compiled_step, _run_scan_step  # noqa: PLC0415
    from companion.diagnostics.step import OwnStepScan  # noqa: PLC0415

    own = loss_fn is None
    step = OwnStepScan(model, False) if own else _compiled_step(model, loss_fn, False)
    ok, bad, _ = _run_scan_step(model, step, own, x, y, w)
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


def verify(diagnosis: Any, model: Any, loss_fn: Any, x, y, w) -> Any:
    """``diagnosis`` with ``remedy`` and ``verified`` set, where a mechanical remedy applies."""
    if diagnosis is None or not isinstance(model, keras.Model):
        return diagnosis
    try:
        found = _verify(diagnosis, model, loss_fn, x, y, w)
    except Exception as error:  # the doctor's own failure: said, not raised
        found = (None, f"not verified: the re-run with the remedy failed ({type(error).__name__}: {error})"[:300])
    if found is None:
        return diagnosis
    remedy, verified = found
    from companion.diagnostics.doctor import replace  # noqa: PLC0415

    return replace(diagnosis, remedy=remedy if remedy is not None else diagnosis.remedy, verified=verified)


def _verify(d, model, loss_fn, x, y, w):
    if d.cause in ("overflow", "divergence") and d.dtype in LOW_PRECISION:
        layer = _layer(model, d.layer)
        if layer is None:
            return None
        name = type(layer).__name__
        remedy = f"compute {d.layer} in float32: {name}(..., dtype=\"float32\") (its variables are float32 already)"
        before = layer.dtype_policy
        try:
            layer.dtype_policy = "float32"
            finite = _finite_step(model, loss_fn, x, y, w)
        finally:
            layer.dtype_policy = before
        what = f"{d.layer}'s dtype policy float32"
        return remedy, (f"verified: the step is finite with {what}" if finite
                        else f"not verified: the step is still non-finite with {what}")
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
            return remedy, "not verified: every row of the batch holds a non-finite value"
        finite = _finite_step(model, loss_fn, _without(x, keep), _without(y, keep), _without(w, keep))
        return remedy, (f"verified: the step is finite without {label}" if finite
                        else f"not verified: the step is still non-finite without {label}")
    return None
