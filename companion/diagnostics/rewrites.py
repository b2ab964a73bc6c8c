"""The remedy written against the user's line, and the clamp that applies it to a re-run.

:func:`choose` writes the call to write instead on the user's own line, from the op (for
a gradient op, the forward op), the cause, the dtype and the line's text with the two
after it; where the line does not spell the op (it is inside a TensorFlow or Keras
function the user cannot edit) it says so and clamps that function's input instead.
:func:`choice` also returns the :class:`Clamp` that applies the remedy mechanically, and
:func:`verify_clamp` runs a check with it on the calls made from that file and line
only, putting every patched callable back afterwards. :mod:`.remedies` decides which
remedy a diagnosis gets and verifies it on a copy of the failing step.
"""

from __future__ import annotations

from typing import Any, Callable

import ast
import builtins
import contextlib
import dataclasses
import functools
import linecache
import math
import os
import re
import sys

import numpy as np
import tensorflow as tf

from companion.diagnostics import user_line
from companion.diagnostics.line_rewrite import (
    LineRewrite, double_where, finite_mask, l2_normalize, line_rewritten, softmax, softplus,
)
from companion.diagnostics.user_line import SPELLING

__all__ = ["Clamp", "LineRewrite", "choice", "choose", "verify_clamp"]


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

#: Library functions that take the square root of a variance (singular where it is 0).
STDS = re.compile(r"\b((?:tf\.|keras\.|np\.)?(?:math\.|ops\.)?(?:reduce_std|std))\(")

#: Calls that only reduce or combine (never the library function that holds the op).
GENERIC = frozenset({"reduce_mean", "reduce_sum", "mean", "sum", "maximum", "minimum", "where", "cast", "abs",
                     "square", "add", "multiply", "subtract", "reshape", "concat", "stack"})


#: Library functions whose Sqrt is singular at 0, each with the form the remedy writes
#: instead, why, the form that applies it to a re-run, and the check's words.
_SQRT_INSIDE = (
    (NORMS, "tf.sqrt(tf.maximum(tf.reduce_sum(tf.square(x), axis=a), {eps:.3g}))",
     "the norm's square clamped: a finite value, and a zero gradient at 0",
     lambda short, eps: _clamped_norm(short, eps), "{name}'s square clamped at {eps:.3g}"),
    (STDS, "tf.sqrt(tf.math.reduce_variance(x, axis=a) + {eps:.3g})",
     "sqrt(var + eps): a variance of 0, as of a constant or a batch of one, gets a finite gradient",
     lambda short, eps: _std_with_eps(eps), "{name} as sqrt(var + {eps:.3g})"),
)


def _inside_library(at: str, op: str, line: str, eps: float) -> tuple[str, "Clamp | None"]:
    """The remedy for an op inside a TensorFlow or Keras function the user calls and cannot edit."""
    if op == "Sqrt":
        for pattern, written, why, form, what in _SQRT_INSIDE:
            found = pattern.search(line)
            if found is not None:
                name = found.group(1)
                short = name.rpartition(".")[2]
                return (f"{at}the Sqrt is inside {name}, which you cannot edit: {name}(x, axis=a) -> "
                        f"{written.format(eps=eps)} ({why})",
                        Clamp((short,), form(short, eps), what.format(name=name, eps=eps)))
    calls = [c for c in re.findall(r"([\w.]+)\(", line) if c.rpartition(".")[2] not in GENERIC]
    inside = calls[-1] if calls else "a library function"
    return (f"{at}the {op} is inside {inside}, which you cannot edit: keep its input off the edge "
            f"(tf.maximum(x, {eps:.3g}) for an input that reaches 0), or pass that function's own "
            "epsilon argument", None)


#: Inputs tried, in this order, as the safe value of a double where.
SAFE_CANDIDATES = (1.0, 0.0, 0.5, 2.0, -1.0)

#: How a branch spells an op (besides the ``SPELLING`` of the op's own call).
def _where_trap(at: str, op: str | None, source: str | None, code: str, dtype: str | None) -> str:
    """The double where for a ``where_trap``, with a safe value at which the branch is finite.

    The safe value is the first of :data:`SAFE_CANDIDATES` at which the branch of the
    user's ``tf.where`` that holds the op (or every branch, when the line does not say
    which) has a finite value and a finite gradient, tried by evaluating that branch on
    a constant of the op's dtype; ``1.0`` is the pole of ``1 / (1 - x)``, ``0.0`` that
    of ``log(x)``. Where the branch cannot be tried (no ``tf.where`` or expression on
    the line, a name that is not a TensorFlow, Keras, NumPy or math function), the
    remedy says what the value must be instead of naming one.
    """
    safe = _safe_value(op, source, code, dtype)
    value, why = ("s", "s, a value") if safe is None else (repr(safe), repr(safe))
    return (f"{at}a double where: tf.where(c, f(x), y) -> tf.where(c, f(tf.where(c, x, {value})), y) "
            f"(companion.numerics.double_where(c, f, x, y)): the unselected branch sees {why} where f "
            "and its gradient are finite")


def _finite_at(branch, namespace: dict, value: float, dtype) -> bool:
    """Whether ``branch``, with its free names at ``value``, has a finite value and gradient."""
    try:
        with tf.init_scope():  # eagerly, also when the doctor runs inside a traced function
            point = tf.constant(value, dtype)
            scope = dict(namespace)
            scope.update({node.id: point for node in ast.walk(branch)
                          if isinstance(node, ast.Name) and user_line.free(node.id, namespace)})
            with tf.GradientTape() as tape:
                tape.watch(point)
                result = tf.convert_to_tensor(
                    eval(compile(ast.Expression(branch), "<branch>", "eval"), scope))  # noqa: S307
            gradient = tape.gradient(result, point)
            finite = bool(tf.reduce_all(tf.math.is_finite(tf.math.abs(result))))
            return finite and (gradient is None or bool(tf.reduce_all(tf.math.is_finite(tf.math.abs(gradient)))))
    except Exception:  # noqa: BLE001 - a branch that cannot run on a constant is not tried
        return False


def _safe_value(op: str | None, source: str | None, code: str, dtype: str | None) -> float | None:
    """The first of :data:`SAFE_CANDIDATES` at which the op's branch is finite, or ``None``."""
    try:
        dtype = tf.as_dtype(dtype or "float32")
    except TypeError:
        dtype = tf.float32
    if not (dtype.is_floating or dtype.is_complex):
        dtype = tf.float32
    expression = user_line.expression(source, code)
    if expression is None:
        return None
    filename = source.rpartition(":")[0] if source else ""
    namespace = dict((user_line.module_of(filename) if filename else None) or {})
    namespace.update({k: v for k, v in {"tf": tf, "np": np, "math": math}.items() if k not in namespace})
    for node in ast.walk(expression):
        if isinstance(node, ast.Call):
            function = user_line.resolve(node.func, namespace)
            if function is None or not user_line.pure(function):
                return None  # a call the doctor will not make on the user's behalf
    branches = user_line.branches(expression)
    tried = [b for b in branches if user_line.holds(b, op)] or branches
    for value in SAFE_CANDIDATES:
        if all(_finite_at(branch, namespace, value, dtype) for branch in tried):
            return value
    return None


#: What classify says of a log or division at 0 inside TensorFlow's own gradient formula.
GRADIENT_EDGE = re.compile(r"inside TensorFlow's gradient of (\w+): argument (\d+) \((\w+)\) of")


def _snake(op: str) -> str:
    """How Python spells an op's function: ``Igamma`` -> ``igamma``, ``BesselI1`` -> ``bessel_i1``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", op).lower()


def _gradient_edge(d, at: str, line: str, eps: float) -> "tuple[str, Clamp | None] | None":
    """A log or division at 0 inside TensorFlow's gradient of the op the line calls: that argument kept off 0.

    TensorFlow's gradient of ``igamma(a, x)`` computes ``(a - 1) * log(x)``: at ``a = 1,
    x = 0`` it is ``0 * -inf = NaN`` though the function and its true derivative are
    finite there. The user cannot edit the gradient; the argument it takes the log of
    (found by value, see :func:`~companion.diagnostics.causes.classify`) is clamped at
    the dtype's eps on the user's line instead.
    """
    found = GRADIENT_EDGE.search(d.inputs_summary or "")
    if found is None or d.cause not in ("log_of_zero", "division_by_zero", "domain_edge"):
        return None
    op, index, argument = found.group(1), int(found.group(2)) - 1, found.group(3)
    name = _snake(op)
    call = re.search(rf"((?:[A-Za-z_]\w*\.)*{re.escape(name)})\(", line)
    if call is None:
        return None
    from companion.diagnostics.causes import argument_names  # noqa: PLC0415 - causes imports nothing of ours

    names = argument_names(op) or [argument]
    before = ", ".join(names)
    after = ", ".join(f"tf.maximum({n}, {eps:.3g})" if i == index else n for i, n in enumerate(names))
    spelled = call.group(1)
    return (f"{at}the {d.op} at 0 is in TensorFlow's gradient of {spelled}, which you cannot edit: "
            f"{spelled}({before}) -> {spelled}({after}) ({argument} kept off 0, where that gradient is "
            "0 * log 0 or 1/0)",
            Clamp((name,), _nth(index, argument, lambda x: tf.maximum(x, _like(eps, x))),
                  f"{name}'s {argument} clamped at {eps:.3g}"))


#: The sparse cross-entropies a line may call: the label argument's position and keyword.
SPARSE_LOSSES = {"sparse_softmax_cross_entropy_with_logits": (0, "labels"),
                 "sparse_categorical_crossentropy": (0, "y_true")}

#: What classify says of labels outside the logits' classes.
LABELS = re.compile(r"outside \[0, (\d+)\).*the labels run from (-?\d+) to (-?\d+)")


def _labels_on_line(at: str, line: str, summary: str) -> tuple[str | None, "Clamp | None"]:
    """Labels outside ``[0, classes)`` on the user's call of a sparse cross-entropy: shifted, or masked."""
    found = LABELS.search(summary)
    call = next(((m, name) for name in SPARSE_LOSSES
                 for m in [re.search(rf"((?:[A-Za-z_]\w*\.)*{name})\(", line)] if m), None)
    if found is None or call is None:
        return None, None
    classes, low, high = (int(v) for v in found.groups())
    spelled, name = call[0].group(1), call[1]
    index, keyword = SPARSE_LOSSES[name]
    if low != 0 and high - low < classes:
        shift = f"{keyword} - {low}" if low > 0 else f"{keyword} + {-low}"
        return (f"{at}labels from 0: {spelled}({keyword}, ...) -> {spelled}({shift}, ...) (the labels run from "
                f"{low} to {high}; the logits have {classes} classes, 0 to {classes - 1})",
                Clamp((name,), _labels(index, keyword, lambda y: y - tf.cast(low, y.dtype), None),
                      f"the labels shifted by {-low}"))
    valid = f"(({keyword} >= 0) & ({keyword} < {classes}))"
    return (f"{at}labels outside [0, {classes}) ignored: {spelled}({keyword}, ...) -> "
            f"{spelled}(tf.where({valid}, {keyword}, 0), ...) * tf.cast({valid}, tf.float32) (or give the "
            f"logits {high + 1} classes if they are classes)",
            Clamp((name,), _labels(index, keyword, lambda y: tf.where((y >= 0) & (y < classes), y, tf.zeros_like(y)),
                                   lambda y: (y >= 0) & (y < classes)),
                  f"the labels outside [0, {classes}) weighted 0"))


def _labels(index: int, keyword: str, relabel, valid):
    """A sparse cross-entropy call with its labels changed by ``relabel`` (and weighted by ``valid``)."""

    def call(original, *args, **kwargs):
        args = list(args)
        labels = tf.convert_to_tensor(args[index] if len(args) > index else kwargs[keyword])
        if len(args) > index:
            args[index] = relabel(labels)
        else:
            kwargs[keyword] = relabel(labels)
        result = original(*args, **kwargs)
        return result if valid is None else result * tf.cast(tf.reshape(valid(labels), tf.shape(result)), result.dtype)

    return call


def choose(d) -> str | None:
    """The first remedy for diagnosis ``d``, written against its line, or ``None``.

    Chosen from the op (for a gradient op, the forward op it differentiates), the cause,
    the dtype, and the text of the user's line and the two after it. Mechanical
    remedies that depend on the model (a layer's dtype policy, the learning rate or
    ``clipnorm``, the batch's rows) are :func:`verify`'s, which also re-runs the failing
    step with a clamp written here applied to the user's line (:func:`choice`).
    """
    return choice(d)[0]


def choice(d) -> tuple[str | None, "Clamp | None"]:
    """``(remedy, clamp)``: :func:`choose`'s remedy, and how to apply it mechanically (or ``None``)."""
    if d is None or d.cause in ("nonfinite_input", "not_reproducible", "unclassified"):
        return None, None
    op = d.forward_op or d.op
    where, code = _context(d)
    at = f"at {where}: " if where else ""
    line = (d.code or "").strip()
    eps = _eps(d.dtype)
    if d.cause == "compiled_only":
        return "compile without XLA: model.compile(..., jit_compile=False) (or tf.function(jit_compile=False))", None
    if d.cause == "where_trap":
        safe = _safe_value(op, d.source, line, d.dtype)
        return _where_trap(at, op, d.source, line, d.dtype), (
            None if safe is None else LineRewrite(double_where(op, safe), f"the double where (safe value {safe!r})"))
    if d.cause == "label_out_of_range":
        return _labels_on_line(at, line, d.inputs_summary or "")
    if d.cause == "inf_arithmetic" and re.search(r"-\s*(np\.|math\.|float\(\")?inf", code):
        mask = -3e4 if d.dtype in ("float16", "bfloat16") else -1e9
        return (f"{at}a large finite negative mask instead of -inf: -1e9 (float32) or -3e4 (float16)",
                LineRewrite(finite_mask(mask), f"-inf replaced by {mask:g}"))
    edge = _gradient_edge(d, at, line, eps)
    if edge is not None:
        return edge
    if not _spelled(op, line) and op in SPELLING and d.cause != "overflow":
        return _inside_library(at, op, line, eps)
    spelled = (SPELLING.get(op, "").rpartition(".")[2],)
    if op == "Sqrt" and d.cause in ("singular_derivative", "domain_edge"):
        return (f"{at}tf.sqrt(x) -> tf.sqrt(tf.maximum(x, {eps:.3g})) (x clamped at {d.dtype or 'float32'}'s "
                "eps: a finite value, and a zero gradient below it)",
                Clamp(spelled, _first(lambda x: tf.maximum(x, _like(eps, x))), f"sqrt's input clamped at {eps:.3g}"))
    if op == "Log" and d.cause in ("log_of_zero", "domain_edge"):
        return (f"{at}tf.math.log(x) -> tf.math.log(tf.maximum(x, {eps:.3g})) (or the loss from logits, "
                "from_logits=True)",
                Clamp(spelled, _first(lambda x: tf.maximum(x, _like(eps, x))), f"log's input clamped at {eps:.3g}"))
    if op == "Pow" and d.cause == "pow_negative_base":
        return (f"{at}tf.pow(x, p) -> companion.numerics.signed_pow(x, p) (sign(x) * |x|**p, finite gradients)",
                Clamp(spelled, _instead("signed_pow"), "signed_pow instead of pow"))
    if op == "Pow" and d.cause in ("singular_derivative", "division_by_zero"):
        return (f"{at}tf.pow(x, p) -> companion.numerics.safe_pow(x, p) (0 for x <= 0, finite gradients)",
                Clamp(spelled, _instead("safe_pow"), "safe_pow instead of pow"))
    if op in ("Acos", "Asin"):
        name = SPELLING[op]
        return (f"{at}{name}(x) -> {name}(tf.clip_by_value(x, -1 + {eps:.3g}, 1 - {eps:.3g}))",
                Clamp(spelled, _first(lambda x: tf.clip_by_value(x, _like(-1 + eps, x), _like(1 - eps, x))),
                      f"{spelled[0]}'s input clipped to [-1 + {eps:.3g}, 1 - {eps:.3g}]"))
    if op == "Atan2":
        return (f"{at}tf.atan2(y, x) -> tf.atan2(y, x + {eps:.3g}) (the point moved off the origin)",
                Clamp(spelled, _second(lambda x: x + _like(eps, x)), f"atan2's x moved by {eps:.3g}"))
    if op == "Angle":
        return (f"{at}tf.math.angle(z) -> tf.math.angle(z + {eps:.3g}) (the point moved off the origin)",
                Clamp(spelled, _first(lambda z: z + _like(eps, z)), f"angle's input moved by {eps:.3g}"))
    if op == "Lgamma":
        return (f"{at}tf.math.lgamma(x) -> tf.math.lgamma(tf.maximum(x, {eps:.3g})) (off the pole at 0)",
                Clamp(spelled, _first(lambda x: tf.maximum(x, _like(eps, x))), f"lgamma's input clamped at {eps:.3g}"))
    if d.cause == "division_by_zero":
        if re.search(r"\b(tf\.norm|tf\.linalg\.norm|ops\.norm|euclidean_norm)\(", code):
            return (f"{at}x / norm(x) -> tf.math.l2_normalize(x, axis) (a norm in the denominator: "
                    "tf.math.divide_no_nan leaves the norm's own 0/0 gradient)"), LineRewrite(
                        l2_normalize, "x / norm(x) rewritten as tf.math.l2_normalize(x, axis)")
        if op in ("Rsqrt",):
            return (f"{at}tf.math.rsqrt(x) -> tf.math.rsqrt(tf.maximum(x, {eps:.3g}))",
                    Clamp(spelled, _first(lambda x: tf.maximum(x, _like(eps, x))),
                          f"rsqrt's input clamped at {eps:.3g}"))
        return (f"{at}x / y -> tf.math.divide_no_nan(x, y) (0 where y == 0, and a zero gradient there)",
                _division_clamp(line))
    if d.cause == "overflow" and op == "Exp":
        if re.search(r"log\(\s*1(\.0*)?\s*\+", code):
            return f"{at}tf.math.log(1 + tf.exp(x)) -> tf.nn.softplus(x)", LineRewrite(
                softplus, "log(1 + exp(x)) rewritten as tf.nn.softplus(x)")
        if re.search(r"reduce_sum\(", code):
            return f"{at}exp(x) / reduce_sum(exp(x)) -> tf.nn.softmax(x, axis) (exp of x - max(x))", LineRewrite(
                softmax, "exp(x) / reduce_sum(exp(x)) rewritten as tf.nn.softmax(x, axis)")
        limit = _exp_limit(d.dtype)
        return (f"{at}tf.exp(x) -> tf.exp(tf.minimum(x, {limit:g})) (half the log of "
                f"{d.dtype or 'float32'}'s max: exp of it, even squared, is finite)",
                Clamp(("exp",), _first(lambda x: tf.minimum(x, _like(limit, x))), f"exp's input clamped at {limit:g}"))
    return None, None


# --------------------------------------------------------------------------------------
# A clamp on the user's line, applied for one re-run of the failing step
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Clamp:
    """How :func:`verify` applies a remedy written against the user's line.

    Attributes:
        names: the last name of each callable the line may spell (``"sqrt"`` for
            ``tf.sqrt(`` and ``tf.math.sqrt(``), or ``"/"`` for the division operator.
        call: ``call(original, *args, **kwargs)``: the call as the remedy writes it.
        what: the remedy in a few words, for the report.
    """

    names: tuple[str, ...]
    call: Callable[..., Any]
    what: str


def _like(value: float, x):
    x = tf.convert_to_tensor(x)
    return tf.cast(value, x.dtype)


def _first(clamp):
    def call(original, x, *args, **kwargs):
        return original(clamp(tf.convert_to_tensor(x)), *args, **kwargs)

    return call


def _nth(index: int, keyword: str, clamp):
    """A call with its ``index``-th argument (or the keyword ``keyword``) clamped."""

    def call(original, *args, **kwargs):
        args = list(args)
        if len(args) > index:
            args[index] = clamp(tf.convert_to_tensor(args[index]))
        elif keyword in kwargs:
            kwargs[keyword] = clamp(tf.convert_to_tensor(kwargs[keyword]))
        return original(*args, **kwargs)

    return call


def _second(clamp):
    def call(original, y, x, *args, **kwargs):
        return original(y, clamp(tf.convert_to_tensor(x)), *args, **kwargs)

    return call


def _instead(name: str):
    def call(original, x, p, *args, **kwargs):
        from companion import numerics  # noqa: PLC0415 - numerics is not the doctor's import

        return getattr(numerics, name)(x, p)

    return call


def _clamped_norm(name: str, eps: float):
    """``sqrt(maximum(reduce_sum(square(x), axis), eps))`` for a call of ``tf.norm``-like ``name``."""

    def call(original, x, *args, **kwargs):
        if name == "reduce_euclidean_norm":
            axis = args[0] if args else kwargs.get("axis")
            keepdims = args[1] if len(args) > 1 else kwargs.get("keepdims", False)
        else:
            order = args[0] if args else kwargs.get("ord", None)
            if order not in (None, "euclidean", 2, 2.0, "fro"):
                return original(x, *args, **kwargs)  # another norm: not what the remedy rewrites
            axis = args[1] if len(args) > 1 else kwargs.get("axis")
            keepdims = args[2] if len(args) > 2 else kwargs.get("keepdims", False)
        x = tf.convert_to_tensor(x)
        square = tf.reduce_sum(tf.square(x), axis=axis, keepdims=bool(keepdims))
        return tf.sqrt(tf.maximum(square, tf.cast(eps, square.dtype)))

    return call


def _std_with_eps(eps: float):
    """``sqrt(reduce_variance(x, axis) + eps)`` for a call of ``std(x, axis, keepdims)``."""

    def call(original, x, *args, **kwargs):
        axis = args[0] if args else kwargs.get("axis")
        keepdims = args[1] if len(args) > 1 else kwargs.get("keepdims", False)
        x = tf.convert_to_tensor(x)
        if not x.dtype.is_floating:
            return original(x, *args, **kwargs)
        variance = tf.math.reduce_variance(x, axis=axis, keepdims=bool(keepdims))
        return tf.sqrt(variance + tf.cast(eps, variance.dtype))

    return call


#: Division functions a line may spell instead of ``/``.
DIVISIONS = ("divide", "truediv", "realdiv", "true_divide", "div")


def _division_clamp(line: str) -> "Clamp":
    spelled = tuple(n for n in DIVISIONS if re.search(rf"\b{n}\(", line))

    def call(original, x, y, *args, **kwargs):
        x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
        if not (x.dtype.is_floating and y.dtype.is_floating):
            return original(x, y, *args, **kwargs)
        return tf.math.divide_no_nan(x, tf.cast(y, x.dtype))

    return Clamp(spelled or ("/",), call, "divide_no_nan instead of the division")


def _holders(namespace: dict, line: str, name: str) -> list[tuple[Any, str]]:
    """``(object, attribute)`` pairs that the line's spellings of ``name(`` look up."""
    found = []
    for dotted in re.findall(rf"(?<![\w.])((?:[A-Za-z_]\w*\.)*{re.escape(name)})\(", line):
        parts = dotted.split(".")
        if len(parts) == 1:
            if name in namespace:
                found.append((namespace, name))
            continue
        holder = namespace.get(parts[0], getattr(builtins, parts[0], None))
        for part in parts[1:-1]:
            holder = getattr(holder, part, None)
        if holder is not None and callable(getattr(holder, name, None)):
            found.append((holder, name))
    unique, seen = [], set()
    for holder, attribute in found:
        if (id(holder), attribute) not in seen:
            seen.add((id(holder), attribute))
            unique.append((holder, attribute))
    return unique


@contextlib.contextmanager
def _patched(clamp: Clamp, filename: str, lineno: int, line: str):
    """Each callable the line spells replaced by the clamp's form, for calls from ``filename:lineno``.

    Yields a list that counts the calls the form replaced. Everything is put back
    when the block ends, also on an error.
    """
    applied: list[int] = []
    target = os.path.realpath(filename)

    def from_line(frame) -> bool:
        return frame is not None and frame.f_lineno == lineno and os.path.realpath(frame.f_code.co_filename) == target

    def wrap(original, swap=False):
        @functools.wraps(original)
        def replaced(*args, **kwargs):
            if not from_line(sys._getframe(1)):
                return original(*args, **kwargs)
            applied.append(1)
            if swap:  # __rtruediv__(self, other) is other / self
                return clamp.call(lambda a, b, *r, **k: original(b, a, *r, **k), args[1], args[0], *args[2:], **kwargs)
            return clamp.call(original, *args, **kwargs)

        return replaced

    undo = []
    try:
        if clamp.names == ("/",):
            for cls in (tf.Tensor, type(tf.constant(0.0))):
                for dunder, swap in (("__truediv__", False), ("__rtruediv__", True)):
                    if dunder in vars(cls):
                        undo.append((cls, dunder, vars(cls)[dunder]))
                        setattr(cls, dunder, wrap(vars(cls)[dunder], swap))
        else:
            namespace = user_line.module_of(filename)
            for name in clamp.names:
                for holder, attribute in _holders(namespace or {}, line, name):
                    if isinstance(holder, dict):
                        undo.append((holder, attribute, holder[attribute]))
                        holder[attribute] = wrap(holder[attribute])
                    else:
                        undo.append((holder, attribute, getattr(holder, attribute)))
                        setattr(holder, attribute, wrap(getattr(holder, attribute)))
        yield applied
    finally:
        for holder, attribute, original in reversed(undo):
            if isinstance(holder, dict):
                holder[attribute] = original
            else:
                setattr(holder, attribute, original)


def verify_clamp(d, clamp: Clamp, finite_run: Callable[[], bool]) -> str | None:
    """``finite_run()`` with the clamp on ``d``'s line: the verdict, or ``None`` if it was never applied."""
    if not d.source or not d.code:
        return None
    filename, _, number = d.source.rpartition(":")
    try:
        lineno = int(number)
    except ValueError:
        return None
    patched = line_rewritten(clamp, filename, lineno) if isinstance(clamp, LineRewrite) else _patched(
        clamp, filename, lineno, d.code)
    with patched as applied:
        finite = finite_run()
    if not applied:  # the re-run never called what the line spells: nothing was checked
        return None
    at = f"{os.path.basename(filename)}:{lineno}"
    return (f"verified: the step is finite with {clamp.what} at {at}" if finite
            else f"not verified: the step is still non-finite with {clamp.what} at {at}")
