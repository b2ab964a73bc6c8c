"""A remedy chosen from the op and its context, applied to a copy of the failing step, and checked.

The fix in :data:`~companion.diagnostics.CAUSES` is the cause's; the remedy here is the
case's, where it is mechanical and can be tried on the failing step itself:

* an overflow in a layer that computes in float16 or bfloat16 (a mixed-precision
  policy): that layer's policy to float32 (``dtype="float32"``, the layer's variables
  are float32 already), the cure Keras' mixed-precision guide gives, not the cause's
  generic list;
* a NaN or Inf in the batch: the step without the rows that hold it (clean or drop them
  in the input pipeline);
* values that grew over the previous steps (``divergence``): the optimizer as compiled
  with a learning rate ten times smaller (written as the call to make);
* anything else: :func:`choose` writes the call to write instead on the user's own line,
  from the op (for a gradient op, the forward op), the cause, and the line's text and
  the two after it (where the op's input came from: a norm in a denominator, an
  ``exp`` that a sum divides, a ``-inf`` mask); where the line does not spell the op
  (it is inside a TensorFlow or Keras function the user cannot edit) the remedy says
  so and clamps that function's input instead.

:func:`verify` applies the remedy to the model for one re-run of the failing step (the
state the doctor saved, every variable restored afterwards, the layer's policy put
back) and says ``"verified: the step is finite with ..."`` or that it is not.
"""

from __future__ import annotations

from typing import Any

import linecache
import math
import os
import re

import keras
import numpy as np
import tensorflow as tf

from companion import _tf_internals
from companion.diagnostics.data import nonfinite_data
from companion.diagnostics.sources import layer_path
from companion.diagnostics.trace import nonfinite_mask

__all__ = ["choose", "verify"]

LOW_PRECISION = ("float16", "bfloat16")


def _layer(model, path: str | None):
    if not path:
        return None
    for layer in _tf_internals.all_layers(model)[1:]:  # every nested layer, not the model
        if layer_path(layer) == path:
            return layer
    return None


def _finite_step(model, loss_fn, x, y, w) -> bool:
    """Whether one scanning step on this batch is finite; changes nothing.

    Eagerly for a compiled model's loss: a check of one batch needs no trace, and a new
    ``tf.function`` per check would count as retracing the doctor's scanning step.
    """
    from companion.diagnostics.doctor import _compiled_step, _run_scan_step  # noqa: PLC0415
    from companion.diagnostics.step import OwnStepScan  # noqa: PLC0415

    own = loss_fn is None
    step = OwnStepScan(model, False) if own else _compiled_step(model, loss_fn, None)
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
        remedy = choose(diagnosis)
        if remedy is None or diagnosis.remedy:
            return diagnosis
        found = (remedy, None)
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
    if d.cause == "divergence":
        return _smaller_learning_rate(model)
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


# --------------------------------------------------------------------------------------
# The remedy written against the user's line
# --------------------------------------------------------------------------------------

#: How the user's code spells an op (what the remedy rewrites).
SPELLING = {
    "Sqrt": "tf.sqrt", "Log": "tf.math.log", "Pow": "tf.pow", "Acos": "tf.acos", "Asin": "tf.asin",
    "Exp": "tf.exp", "Lgamma": "tf.math.lgamma", "Atan2": "tf.atan2", "Angle": "tf.math.angle",
    "Rsqrt": "tf.math.rsqrt", "Reciprocal": "tf.math.reciprocal",
}


def _eps(dtype: str | None) -> float:
    """The dtype's machine epsilon (float32's for an unknown or non-float dtype)."""
    try:
        return float(np.finfo(np.dtype(dtype or "float32")).eps)
    except TypeError:
        return float(np.finfo(np.float32).eps)


def _exp_limit(dtype: str | None) -> float:
    """Half the log of the dtype's largest value: exp of it, even squared, stays finite."""
    try:
        big = float(np.finfo(np.dtype(dtype or "float32")).max)
    except TypeError:
        big = float(np.finfo(np.float32).max)
    return float(math.floor(math.log(big) / 2))


def _context(d) -> tuple[str, str]:
    """``("file:line", text)``: the user's line and the two after it (where its value goes)."""
    if not d.source:
        return "", d.code or ""
    filename, _, line = d.source.rpartition(":")
    try:
        number = int(line)
    except ValueError:
        return os.path.basename(d.source), d.code or ""
    text = " ".join(linecache.getline(filename, number + k).strip() for k in range(3))
    return f"{os.path.basename(filename)}:{number}", text


def _spelled(op: str, code: str) -> bool:
    name = SPELLING.get(op, "").rpartition(".")[2]
    return bool(name) and re.search(rf"\b{re.escape(name)}\(", code) is not None


#: Library functions whose square root is singular at 0 (a norm), and the form to write instead.
NORMS = re.compile(r"\b((?:tf\.|keras\.)?(?:linalg\.|ops\.|math\.)?(?:norm|reduce_euclidean_norm))\(")

#: Calls that only reduce or combine (never the library function that holds the op).
GENERIC = frozenset({"reduce_mean", "reduce_sum", "mean", "sum", "maximum", "minimum", "where", "cast", "abs",
                     "square", "add", "multiply", "subtract", "reshape", "concat", "stack"})


def _inside_library(at: str, op: str, line: str, eps: float) -> str:
    """The remedy for an op inside a TensorFlow or Keras function the user calls and cannot edit."""
    norm = NORMS.search(line)
    if norm is not None and op == "Sqrt":
        name = norm.group(1)
        return (f"{at}the Sqrt is inside {name}, which you cannot edit: {name}(x, axis=a) -> "
                f"tf.sqrt(tf.maximum(tf.reduce_sum(tf.square(x), axis=a), {eps:.3g})) (the norm's square "
                "clamped: a finite value, and a zero gradient at 0)")
    calls = [c for c in re.findall(r"([\w.]+)\(", line) if c.rpartition(".")[2] not in GENERIC]
    inside = calls[-1] if calls else "a library function"
    return (f"{at}the {op} is inside {inside}, which you cannot edit: keep its input off the edge "
            f"(tf.maximum(x, {eps:.3g}) for an input that reaches 0), or pass that function's own "
            "epsilon argument")


def choose(d) -> str | None:
    """The first remedy for diagnosis ``d``, written against its line, or ``None``.

    Chosen from the op (for a gradient op, the forward op it differentiates), the cause,
    the dtype, and the text of the user's line and the two after it. Mechanical
    remedies that depend on the model (a layer's dtype policy, the learning rate, the
    batch's rows) are :func:`verify`'s.
    """
    if d is None or d.cause in ("nonfinite_input", "not_reproducible", "unclassified"):
        return None
    op = d.forward_op or d.op
    where, code = _context(d)
    at = f"at {where}: " if where else ""
    line = (d.code or "").strip()
    eps = _eps(d.dtype)
    if d.cause == "compiled_only":
        return "compile without XLA: model.compile(..., jit_compile=False) (or tf.function(jit_compile=False))"
    if d.cause == "where_trap":
        return (f"{at}a double where: tf.where(c, f(x), y) -> tf.where(c, f(tf.where(c, x, 1.0)), y) "
                "(companion.numerics.double_where(c, f, x, y)): the unselected branch sees a safe input")
    if d.cause == "inf_arithmetic" and re.search(r"-\s*(np\.|math\.|float\(\")?inf", code):
        return f"{at}a large finite negative mask instead of -inf: -1e9 (float32) or -3e4 (float16)"
    if not _spelled(op, line) and op in SPELLING and d.cause != "overflow":
        return _inside_library(at, op, line, eps)
    if op == "Sqrt" and d.cause in ("singular_derivative", "domain_edge"):
        return (f"{at}tf.sqrt(x) -> tf.sqrt(tf.maximum(x, {eps:.3g})) (x clamped at {d.dtype or 'float32'}'s "
                "eps: a finite value, and a zero gradient below it)")
    if op == "Log" and d.cause in ("log_of_zero", "domain_edge"):
        return (f"{at}tf.math.log(x) -> tf.math.log(tf.maximum(x, {eps:.3g})) (or the loss from logits, "
                "from_logits=True)")
    if op == "Pow" and d.cause == "pow_negative_base":
        return f"{at}tf.pow(x, p) -> companion.numerics.signed_pow(x, p) (sign(x) * |x|**p, finite gradients)"
    if op == "Pow" and d.cause in ("singular_derivative", "division_by_zero"):
        return f"{at}tf.pow(x, p) -> companion.numerics.safe_pow(x, p) (0 for x <= 0, finite gradients)"
    if op in ("Acos", "Asin"):
        name = SPELLING[op]
        return f"{at}{name}(x) -> {name}(tf.clip_by_value(x, -1 + {eps:.3g}, 1 - {eps:.3g}))"
    if op == "Atan2":
        return f"{at}tf.atan2(y, x) -> tf.atan2(y, x + {eps:.3g}) (the point moved off the origin)"
    if op == "Angle":
        return f"{at}tf.math.angle(z) -> tf.math.angle(z + {eps:.3g}) (the point moved off the origin)"
    if op == "Lgamma":
        return f"{at}tf.math.lgamma(x) -> tf.math.lgamma(tf.maximum(x, {eps:.3g})) (off the pole at 0)"
    if d.cause == "division_by_zero":
        if re.search(r"\b(tf\.norm|tf\.linalg\.norm|ops\.norm|euclidean_norm)\(", code):
            return (f"{at}x / norm(x) -> tf.math.l2_normalize(x, axis) (a norm in the denominator: "
                    "tf.math.divide_no_nan leaves the norm's own 0/0 gradient)")
        if op in ("Rsqrt",):
            return f"{at}tf.math.rsqrt(x) -> tf.math.rsqrt(tf.maximum(x, {eps:.3g}))"
        return f"{at}x / y -> tf.math.divide_no_nan(x, y) (0 where y == 0, and a zero gradient there)"
    if d.cause == "overflow" and op == "Exp":
        if re.search(r"log\(\s*1(\.0*)?\s*\+", code):
            return f"{at}tf.math.log(1 + tf.exp(x)) -> tf.nn.softplus(x)"
        if re.search(r"reduce_sum\(", code):
            return f"{at}exp(x) / reduce_sum(exp(x)) -> tf.nn.softmax(x, axis) (exp of x - max(x))"
        limit = _exp_limit(d.dtype)
        return (f"{at}tf.exp(x) -> tf.exp(tf.minimum(x, {limit:g})) (half the log of "
                f"{d.dtype or 'float32'}'s max: exp of it, even squared, is finite)")
    return None


def _smaller_learning_rate(model):
    """The optimizer as compiled, with a learning rate ten times smaller, as the call to write."""
    optimizer = getattr(model, "optimizer", None)
    inner = getattr(optimizer, "inner_optimizer", None) or optimizer  # a LossScaleOptimizer's
    rate = getattr(inner, "learning_rate", None)
    try:
        value = float(np.asarray(rate.numpy() if hasattr(rate, "numpy") else rate))
    except (TypeError, ValueError):
        return ("a learning rate ten times smaller in the optimizer (or clipnorm=1.0)",
                None)
    name = type(inner).__name__
    return (f"recompile with a learning rate ten times smaller: keras.optimizers.{name}"
            f"(learning_rate={value / 10:.3g}) (was {value:.3g}; the weights grew step after step)", None)
