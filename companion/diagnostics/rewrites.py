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

__all__ = ["Clamp", "choice", "choose", "verify_clamp"]

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


def _inside_library(at: str, op: str, line: str, eps: float) -> tuple[str, "Clamp | None"]:
    """The remedy for an op inside a TensorFlow or Keras function the user calls and cannot edit."""
    norm = NORMS.search(line)
    if norm is not None and op == "Sqrt":
        name = norm.group(1)
        return (f"{at}the Sqrt is inside {name}, which you cannot edit: {name}(x, axis=a) -> "
                f"tf.sqrt(tf.maximum(tf.reduce_sum(tf.square(x), axis=a), {eps:.3g})) (the norm's square "
                "clamped: a finite value, and a zero gradient at 0)",
                Clamp((name.rpartition(".")[2],), _clamped_norm(name.rpartition(".")[2], eps),
                      f"{name}'s square clamped at {eps:.3g}"))
    calls = [c for c in re.findall(r"([\w.]+)\(", line) if c.rpartition(".")[2] not in GENERIC]
    inside = calls[-1] if calls else "a library function"
    return (f"{at}the {op} is inside {inside}, which you cannot edit: keep its input off the edge "
            f"(tf.maximum(x, {eps:.3g}) for an input that reaches 0), or pass that function's own "
            "epsilon argument", None)


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
        return (f"{at}a double where: tf.where(c, f(x), y) -> tf.where(c, f(tf.where(c, x, 1.0)), y) "
                "(companion.numerics.double_where(c, f, x, y)): the unselected branch sees a safe input"), None
    if d.cause == "inf_arithmetic" and re.search(r"-\s*(np\.|math\.|float\(\")?inf", code):
        return f"{at}a large finite negative mask instead of -inf: -1e9 (float32) or -3e4 (float16)", None
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
                    "tf.math.divide_no_nan leaves the norm's own 0/0 gradient)"), None
        if op in ("Rsqrt",):
            return (f"{at}tf.math.rsqrt(x) -> tf.math.rsqrt(tf.maximum(x, {eps:.3g}))",
                    Clamp(spelled, _first(lambda x: tf.maximum(x, _like(eps, x))),
                          f"rsqrt's input clamped at {eps:.3g}"))
        return (f"{at}x / y -> tf.math.divide_no_nan(x, y) (0 where y == 0, and a zero gradient there)",
                _division_clamp(line))
    if d.cause == "overflow" and op == "Exp":
        if re.search(r"log\(\s*1(\.0*)?\s*\+", code):
            return f"{at}tf.math.log(1 + tf.exp(x)) -> tf.nn.softplus(x)", None
        if re.search(r"reduce_sum\(", code):
            return f"{at}exp(x) / reduce_sum(exp(x)) -> tf.nn.softmax(x, axis) (exp of x - max(x))", None
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


def _module_of(filename: str):
    """The namespace (a module's ``__dict__``) whose code is in ``filename``."""
    target = os.path.realpath(filename)
    name = os.path.basename(target)
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and os.path.basename(path) == name and os.path.realpath(path) == target:
            return vars(module)
    main = sys.modules.get("__main__")
    return vars(main) if main is not None else None  # a notebook's cell or a script


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
            namespace = _module_of(filename)
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
    with _patched(clamp, filename, lineno, d.code) as applied:
        finite = finite_run()
    if not applied:  # the re-run never called what the line spells: nothing was checked
        return None
    at = f"{os.path.basename(filename)}:{lineno}"
    return (f"verified: the step is finite with {clamp.what} at {at}" if finite
            else f"not verified: the step is still non-finite with {clamp.what} at {at}")
