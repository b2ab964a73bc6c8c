"""The documented causes of a NaN, their fixes and book sections, and how each is recognised.

``CAUSES`` maps each cause name that :attr:`Diagnosis.cause
<companion.diagnostics.Diagnosis.cause>` can take to a :class:`Cause`: a description,
the fix (the ``companion`` function or TensorFlow idiom) and the book section that
shows it (``chapter path#anchor``, relative to the book's root). Tools and tests may
rely on the names; new causes are added, none is renamed.

:func:`classify` names the cause from the culprit op of the op-by-op re-run and the
values of its inputs (for a gradient op, the forward op and *its* inputs), and
:func:`inputs_summary` says in one sentence what those inputs were.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np

__all__ = ["CAUSES", "Cause"]


class Cause(NamedTuple):
    """One documented cause: what it is, what to do, where the book shows it.

    Its three fields: ``description``, what happened, in a sentence; ``fix``, what to do
    (the ``companion`` function or the TensorFlow idiom); ``section``, the book chapter
    and anchor that shows it, e.g.
    ``"book/foundations/finite_loss_nan_gradients#the-tf-where-trap"``.
    """

    description: str
    fix: str
    section: str


_FOUNDATIONS = "book/foundations/finite_loss_nan_gradients"
_CHECKLIST = "book/closing/checklist"

CAUSES: dict[str, Cause] = {
    "nonfinite_input": Cause(
        "the batch's inputs, targets or sample weights already hold NaN or Inf",
        "clean the data: check it with np.isfinite or tf.debugging.assert_all_finite "
        "in the pipeline, drop or impute missing values, use tf.math.divide_no_nan "
        "in preprocessing",
        f"{_CHECKLIST}#a-nan-loss-from-the-first-step-the-data",
    ),
    "nonfinite_weights": Cause(
        "a weight is already NaN or Inf before this batch: an earlier step wrote it "
        "(fit applies a non-finite update)",
        "find the step that wrote it: companion.training.train (or SkipNonFinite for "
        "fit) skips non-finite steps and keeps the weights finite; reload a checkpoint",
        "book/tools/training_loop#a-run-with-skipped-steps",
    ),
    "nonfinite_init": Cause(
        "a weight is NaN or Inf before any training step: its initializer or a value "
        "assigned before training set it (a bias of log(0) for a class prior of 0, a "
        "data-dependent initialisation dividing by a spread of 0); no step can cure it",
        "make the initial value finite where it is set: np.log(np.maximum(prior, eps)) for "
        "a log prior, tf.math.divide_no_nan for a spread that can be 0, and check it with "
        "np.isfinite (companion.training.train refuses such a model)",
        f"{_CHECKLIST}#weights-that-are-not-finite-before-the-first-step",
    ),
    "log_of_zero": Cause(
        "log of 0: -Inf forward, and 1/0 in its gradient (often cross-entropy on "
        "probabilities that reach 0 or 1)",
        "tf.math.xlogy(x, y) for x*log(y); losses from logits (from_logits=True, "
        "tf.nn.softmax_cross_entropy_with_logits); tf.math.log_sigmoid; else "
        "log(max(x, tiny)) inside a double where",
        f"{_CHECKLIST}#common-sources-each-in-a-few-lines",
    ),
    "singular_derivative": Cause(
        "a finite function with an infinite derivative there: sqrt or a norm at 0, "
        "x**p with p < 1 at 0, acos/asin at +-1, atan2 or angle at 0, the std of a "
        "constant",
        "companion.numerics.safe_pow / signed_pow for powers; "
        "companion.numerics.double_where around sqrt and norms at 0; "
        "sqrt(var + eps) for a std; clip acos/asin into (-1, 1)",
        f"{_CHECKLIST}#common-sources-each-in-a-few-lines",
    ),
    "pow_negative_base": Cause(
        "a power x**p of a negative base: NaN for a non-integer p, and log(x) = NaN in "
        "the gradient with respect to p",
        "companion.numerics.signed_pow (sign(x) * abs(x)**p) or safe_pow; keep the base "
        "positive (softplus, exp) if it must be",
        "book/case_a/log_exp_power#the-exact-power-safe-pow-and-signed-pow",
    ),
    "division_by_zero": Cause(
        "a division by 0 (x/0 = Inf, 0/0 = NaN), in the op or in its gradient",
        "tf.math.divide_no_nan, or x / (y + eps) with eps from the dtype's finfo, or "
        "companion.numerics.double_where around the division",
        f"{_CHECKLIST}#common-sources-each-in-a-few-lines",
    ),
    "overflow": Cause(
        "a finite computation beyond the dtype's largest value: exp, softplus, a "
        "square, a sum (float32 above 3.4e38, float16 above 65504)",
        "tf.nn.softplus, tf.math.log_sigmoid, tf.reduce_logsumexp instead of the "
        "naive formulas; keep that layer in float32 under mixed precision; loss "
        "scaling; scaled dot-product attention",
        f"{_CHECKLIST}#common-sources-each-in-a-few-lines",
    ),
    "where_trap": Cause(
        "a NaN or Inf in the branch a tf.where did not select: the forward value is "
        "fine, but the gradient of the unselected branch is 0 * Inf = NaN",
        "companion.numerics.double_where: make the unselected branch's input safe too",
        f"{_FOUNDATIONS}#the-tf-where-trap",
    ),
    "domain_edge": Cause(
        "a function outside or at the edge of its domain, or at a pole: log or sqrt "
        "of a negative number, acos of 1.5, lgamma at 0",
        "clip or map the input into the open domain (tf.clip_by_value, softplus for "
        "positive, tanh for (-1, 1))",
        "book/closing/finding_your_own_nan#fit-two-outputs-a-kl-loss-on-raw-features",
    ),
    "inf_arithmetic": Cause(
        "0 * Inf or Inf - Inf, with no more specific cause found",
        "find where the Inf comes from (the op's inputs below) and keep it out, e.g. "
        "with companion.numerics.double_where; a -inf mask: use a large finite "
        "negative number",
        f"{_CHECKLIST}#common-sources-each-in-a-few-lines",
    ),
    "divergence": Cause(
        "values that grew step after step until they overflowed (the loss grew "
        "before it turned non-finite)",
        "a smaller learning rate; clipnorm or global_clipnorm in the optimizer; "
        "normalisation layers",
        f"{_CHECKLIST}#nan-after-n-good-steps",
    ),
    "compiled_only": Cause(
        "the compiled step is non-finite on this batch, but the same computation run "
        "op by op is finite (XLA fuses, reorders and rewrites ops)",
        "train without XLA (jit_compile=False) to confirm; then find the op by "
        "bisection, and report it to TensorFlow if the op-by-op result is right",
        "book/case_a/clipping_and_guards#check-numerics-forward-backward-and-xla",
    ),
    "not_reproducible": Cause(
        "the step was non-finite once, and finite when run again on the same batch, "
        "weights and seeds: non-determinism (a kernel without a deterministic "
        "implementation, a race, a reshuffled batch) or a hardware fault",
        "run with tf.config.experimental.enable_op_determinism() and the same seeds; "
        "save the step (Diagnosis.save) and replay it on another machine; a NaN that "
        "never repeats is skipped by companion.training.train",
        "book/closing/finding_your_own_nan#a-custom-train-step-a-checked-remedy-a-capsule",
    ),
    "label_out_of_range": Cause(
        "an integer class label outside [0, classes) in a sparse cross-entropy: run eagerly on a CPU "
        "the op raises, compiled with XLA (or on a GPU) it returns NaN",
        "labels from 0 to classes - 1: y - 1 for labels that start at 1, as many output units as the "
        "largest label + 1, or a label to ignore given a sample weight of 0 (and any valid label)",
        f"{_CHECKLIST}#a-nan-loss-from-the-first-step-the-data",
    ),
    "learning_rate": Cause(
        "the learning rate at the failing step is 0 or below (a schedule past its end, a wrong sign: "
        "every step climbs the loss), far above the rates before it (a schedule that grows) or still "
        "rising (a warmup that does not end): the weights grew step after step until they overflowed",
        "keep the schedule's rate in (0, its peak]: fix its arguments (decay_rate < 1, "
        "end_learning_rate >= 0) or clip the value it returns with tf.clip_by_value; clipnorm "
        "bounds each step",
        f"{_CHECKLIST}#a-learning-rate-schedule-that-goes-below-zero",
    ),
    "bootstrapped_targets": Cause(
        "targets computed from the model's own outputs (Q-learning and TD targets, "
        "self-distillation) grew with those outputs step after step until they overflowed",
        "bound each step: clipnorm in the optimizer (or a Huber loss); a target network updated "
        "every N steps, rewards scaled to about 1 and a discount below 1",
        f"{_CHECKLIST}#targets-bootstrapped-from-the-model-itself",
    ),
    "nonfinite_update": Cause(
        "the loss and the gradients are finite, but the update writes NaN or Inf: optimizer "
        "arithmetic in a low precision (Adam's epsilon=1e-8 is 0 in float16, so a second "
        "moment of 0 divides by 0), a weight carried beyond its dtype's largest value, or a "
        "layer's moving statistic",
        "an epsilon the variables' dtype holds (1e-4 for float16), or the variables in "
        "float32 (the mixed_float16 policy keeps them so, with a LossScaleOptimizer); "
        "companion.training.train skips such a step",
        f"{_CHECKLIST}#nan-only-in-float16",
    ),
    "unclassified": Cause(
        "a non-finite value whose cause the doctor does not recognise",
        "read the op, its inputs and the line below; locate_nonfinite on a smaller "
        "example",
        "book/tools/training_loop#which-variable-which-op",
    ),
}

LOG_OPS = frozenset({"Log", "Log1p", "Xlogy", "Xlog1py", "LogSoftmax"})
DIVISION_OPS = frozenset({"RealDiv", "Div", "FloorDiv", "TruncateDiv", "Xdivy", "FloorMod", "Reciprocal", "Inv"})
OVERFLOW_OPS = frozenset(
    {
        "Exp", "Expm1", "Softplus", "Square", "Cosh", "Sinh", "Pow", "Mul", "AddV2", "Add", "Sub", "Sum", "Mean",
        "MatMul", "BatchMatMulV2", "BatchMatMulV3", "Conv2D", "Conv1D", "Einsum", "Cast", "AddN", "Prod",
        "SquaredDifference", "Cumsum", "Tan", "Lgamma", "Sqrt", "Softmax",
    }
)
SINGULAR_OPS = frozenset({"Sqrt", "Pow", "Acos", "Asin", "Atan2", "Angle", "ComplexAbs", "EuclideanNorm", "Cbrt"})
SELECT_OPS = frozenset({"Select", "SelectV2"})


def _finite(array: np.ndarray) -> np.ndarray:
    if np.iscomplexobj(array):
        return np.isfinite(array.real) & np.isfinite(array.imag)
    return np.isfinite(np.asarray(array, np.float64))


def _as_float(array):
    if array is None:
        return None
    if np.iscomplexobj(array):
        return array
    return np.asarray(array, np.float64)


def _count(mask: np.ndarray) -> int:
    return int(np.count_nonzero(mask))


def _noun(op: str, index: int, count: int) -> str:
    """``"inputs"``, ``"denominators"``, ``"bases"``... for input ``index`` of ``op``."""
    if op in ("RealDiv", "Div", "FloorDiv", "TruncateDiv", "DivNoNan") and index == 1:
        return "denominators"
    if op == "Pow":
        return "bases" if index == 0 else "exponents"
    if op in ("Xlogy", "Xlog1py") and index == 1:
        return "log arguments"
    return "inputs"


def _fact(op: str, index: int, array: np.ndarray, mask: np.ndarray, what: str) -> str:
    return f"{_count(mask)} of {array.size} {_noun(op, index, array.size)} of {op} {what}"


def classify(event, masked_selects: Sequence = (), *, loss_finite: bool = True) -> tuple[str, str]:
    """The cause (a key of ``CAUSES``) and a one-line summary of the culprit's inputs.

    Args:
        event: an :class:`~companion.diagnostics.trace.OpEvent`, the culprit.
        masked_selects: records of forward ``Select``/``SelectV2`` ops that had a
            non-finite branch and a finite output.
        loss_finite: whether the loss was finite (a non-finite forward value that
            did not reach the loss was masked somewhere).

    Returns:
        ``(cause, summary)``.
    """
    if event.backward:
        forward = event.forward
        if forward is not None and forward.nonfinite and masked_selects:
            select = masked_selects[0]
            return "where_trap", _where_summary(forward, select)
        if forward is not None:
            cause, summary = _forward_cause(forward.op_type, forward.inputs, event, in_backward=True)
            if cause != "unclassified":
                return cause, summary
        # An op of TensorFlow's own gradient formula at an edge (0 * log 0 in Igamma's
        # gradient): read from that op's inputs, and traced to the forward op's argument.
        cause, summary = _forward_cause(event.record.op_type, event.record.inputs, event, in_backward=False)
        if cause != "unclassified" and event.forward_type:
            return cause, summary + _gradient_argument(event)
        return _output_cause(event.record.op_type, event.record.inputs, event)
    cause, summary = _forward_cause(event.record.op_type, event.record.inputs, event, in_backward=False)
    if cause == "unclassified":
        return _output_cause(event.record.op_type, event.record.inputs, event)
    return cause, summary


def _where_summary(forward, select) -> str:
    ins = [_as_float(a) for a in forward.inputs]
    text = f"the tf.where drops non-finite values of {forward.op_type}"
    dropped = text.replace("the ", "a ", 1)
    for index, array in enumerate(ins):
        if array is not None and array.size and not np.iscomplexobj(array):
            zeros = array == 0
            if zeros.any() and forward.op_type in LOG_OPS | DIVISION_OPS | {"Sqrt", "Rsqrt", "Pow"}:
                return f"{_fact(forward.op_type, index, array, zeros, 'are exactly 0')}; {dropped}"
            negative = array < 0
            if negative.any() and forward.op_type in ("Log", "Sqrt", "Pow"):
                return f"{_fact(forward.op_type, index, array, negative, 'are negative')}; {dropped}"
    return text


# --- recognition: what each op's inputs say --------------------------------------------
#
# A forward op's cause is read from its type and its input values by the rules below, in
# order: the first rule whose op types include the op (and, for a rule marked
# ``backward_only``, only when the op is the forward op of a failing gradient) and whose
# check finds offending entries names the cause. A check returns the one-line summary of
# those entries, or None. To recognise a new cause for an op, add a rule here (and the
# cause to CAUSES); causes that no rule names are recognised where RECOGNISED_ELSEWHERE says.


class Rule(NamedTuple):
    """One way an op's inputs make a non-finite value: the op types, the cause, the check."""

    ops: frozenset
    cause: str
    check: Callable[[str, list, list], "str | None"]
    backward_only: bool = False


def _entries(index: int, predicate: Callable[[np.ndarray], np.ndarray], what: str):
    """A check: the entries of real input ``index`` where ``predicate`` holds, "are ``what``"."""

    def check(op: str, real: list, ins: list) -> str | None:
        array = real[index] if len(real) > index else None
        if array is None:
            return None
        mask = predicate(array)
        return _fact(op, index, array, mask, what) if mask.any() else None

    return check


def _log_argument_at_edge(op: str, real: list, ins: list) -> str | None:
    edge = 0 if op == "Xlogy" else -1
    if len(real) > 1 and real[1] is not None and (real[1] == edge).any():
        return _fact(op, 1, real[1], real[1] == edge, f"are exactly {edge}")
    return None


def _pow_parts(real: list):
    if len(real) > 1 and real[0] is not None and real[1] is not None:
        return np.broadcast_arrays(real[0], real[1])
    return None, None


def _pow_of_negative_base(in_backward: bool):
    def check(op: str, real: list, ins: list) -> str | None:
        base, exponent = _pow_parts(real)
        if base is None:
            return None
        # a negative base is NaN forward for a non-integer exponent; its gradient with
        # respect to the exponent is log(base) = NaN for every negative base
        if ((base < 0) & ((exponent != np.round(exponent)) | in_backward)).any():
            return _fact(op, 0, real[0], real[0] < 0, "are negative")
        return None

    return check


def _pow_of_zero_negative_exponent(op: str, real: list, ins: list) -> str | None:
    base, exponent = _pow_parts(real)
    if base is not None and ((base == 0) & (exponent < 0)).any():
        return _fact(op, 0, real[0], real[0] == 0, "are exactly 0 (exponent < 0)")
    return None


def _pow_of_zero_below_one(op: str, real: list, ins: list) -> str | None:
    base, exponent = _pow_parts(real)
    if base is None:
        return None
    singular = (base == 0) & (exponent < 1)
    if singular.any():
        p = float(np.min(exponent[singular]))
        return _fact(op, 0, real[0], real[0] == 0, f"are exactly 0 (exponent {p:.3g} < 1)")
    return None


def _atan2_at_origin(op: str, real: list, ins: list) -> str | None:
    if len(real) > 1 and real[0] is not None and real[1] is not None:
        y, x = np.broadcast_arrays(real[0], real[1])
        origin = (y == 0) & (x == 0)
        if origin.any():
            return f"{_count(origin)} of {origin.size} points of Atan2 are (0, 0)"
    return None


def _complex_at_zero(op: str, real: list, ins: list) -> str | None:
    if ins and ins[0] is not None and (ins[0] == 0).any():
        return _fact(op, 0, ins[0], ins[0] == 0, "are exactly 0")
    return None


def _norm_of_zeros(op: str, real: list, ins: list) -> str | None:
    if real and real[0] is not None and not np.any(real[0]):
        return f"every input of {op} is 0"
    return None


def _division_by_zero(op: str, real: list, ins: list) -> str | None:
    index = 0 if op in ("Reciprocal", "Inv") else 1
    if len(real) > index and real[index] is not None and (real[index] == 0).any():
        return _fact(op, index, real[index], real[index] == 0, "are exactly 0")
    return None


def _labels_out_of_range(op: str, real: list, ins: list) -> str | None:
    """Labels (input 2) outside ``[0, classes)``, ``classes`` the logits' (input 1) last dimension."""
    if len(real) < 2 or real[0] is None or real[1] is None or not np.ndim(real[0]):
        return None
    classes = int(np.shape(real[0])[-1])
    labels = real[1]
    outside = (labels < 0) | (labels >= classes)
    if not outside.any():
        return None
    shown = ", ".join(str(int(v)) for v in np.unique(labels[outside])[:5])
    return (f"{_count(outside)} of {labels.size} labels of {op} are outside [0, {classes}) of the "
            f"logits' {classes} classes ({shown}); the labels run from {int(labels.min())} to {int(labels.max())}")


def _ops(*names: str) -> frozenset:
    return frozenset(names)


_is_zero = lambda a: a == 0  # noqa: E731
_is_negative = lambda a: a < 0  # noqa: E731

#: The recognition rules of forward ops, in the order they are tried.
RULES: tuple[Rule, ...] = (
    Rule(_ops("Log"), "log_of_zero", _entries(0, _is_zero, "are exactly 0")),
    Rule(_ops("Log"), "domain_edge", _entries(0, _is_negative, "are negative")),
    Rule(_ops("Log1p"), "log_of_zero", _entries(0, lambda a: a == -1, "are exactly -1")),
    Rule(_ops("Log1p"), "domain_edge", _entries(0, lambda a: a < -1, "are below -1")),
    Rule(_ops("Xlogy", "Xlog1py"), "log_of_zero", _log_argument_at_edge),
    Rule(_ops("Sqrt", "Rsqrt"), "domain_edge", _entries(0, _is_negative, "are negative")),
    Rule(_ops("Sqrt"), "singular_derivative", _entries(0, _is_zero, "are exactly 0"), backward_only=True),
    Rule(_ops("Rsqrt"), "division_by_zero", _entries(0, _is_zero, "are exactly 0")),
    Rule(_ops("Pow"), "pow_negative_base", _pow_of_negative_base(in_backward=False)),
    Rule(_ops("Pow"), "pow_negative_base", _pow_of_negative_base(in_backward=True), backward_only=True),
    Rule(_ops("Pow"), "division_by_zero", _pow_of_zero_negative_exponent),
    Rule(_ops("Pow"), "singular_derivative", _pow_of_zero_below_one, backward_only=True),
    Rule(_ops("Acos", "Asin"), "domain_edge", _entries(0, lambda a: np.abs(a) > 1, "are outside [-1, 1]")),
    Rule(_ops("Acos", "Asin"), "singular_derivative", _entries(0, lambda a: np.abs(a) == 1, "are exactly +-1"),
         backward_only=True),
    Rule(_ops("Atanh"), "domain_edge", _entries(0, lambda a: np.abs(a) >= 1, "are outside (-1, 1)")),
    Rule(_ops("Lgamma", "Digamma"), "domain_edge",
         _entries(0, lambda a: (a <= 0) & (a == np.round(a)), "are poles (0, -1, -2, ...)")),
    Rule(_ops("Atan2"), "singular_derivative", _atan2_at_origin, backward_only=True),
    Rule(_ops("Angle", "ComplexAbs"), "singular_derivative", _complex_at_zero, backward_only=True),
    Rule(_ops("EuclideanNorm"), "singular_derivative", _norm_of_zeros, backward_only=True),
    Rule(DIVISION_OPS, "division_by_zero", _division_by_zero),
    Rule(_ops("SparseSoftmaxCrossEntropyWithLogits"), "label_out_of_range", _labels_out_of_range),
)

#: The causes no rule of RULES names, and the function that recognises each.
RECOGNISED_ELSEWHERE: dict[str, str] = {
    "nonfinite_input": "companion.diagnostics.doctor (the batch is checked before the re-run)",
    "nonfinite_weights": "companion.diagnostics.doctor (the weights are checked before the re-run)",
    "nonfinite_init": "companion.diagnostics.doctor and .initial (the weights, before any step)",
    "where_trap": "classify (a masked tf.where above a failing gradient)",
    "overflow": "_output_cause (an infinite output from finite inputs, finite and too large in float64)",
    "inf_arithmetic": "_output_cause (0 * Inf, Inf - Inf, a fully masked row)",
    "domain_edge": "_output_cause (a non-finite output from finite inputs) and RULES",
    "divergence": "companion.diagnostics.doctor (grew: the losses before the failure)",
    "compiled_only": "companion.diagnostics.doctor (the compiled step fails, the re-run does not)",
    "not_reproducible": "companion.diagnostics.doctor (the step is finite when run again)",
    "nonfinite_update": "companion.diagnostics.update (the update, applied on copies, from finite gradients)",
    "unclassified": "classify (no rule and no output cause)",
    "learning_rate": "rate_cause (the rate at the failing step and the schedule's rates before it)",
    "bootstrapped_targets": "bootstrapped (the targets at the failing step against the model's own outputs)",
}


def _forward_cause(op: str, inputs: Sequence, event, *, in_backward: bool) -> tuple[str, str]:
    """The cause seen from an op's own type and input values: the first rule of RULES that holds."""
    ins = [_as_float(a) for a in inputs]
    real = [a if a is not None and not np.iscomplexobj(a) else None for a in ins]
    for rule in RULES:
        if op in rule.ops and (in_backward or not rule.backward_only):
            summary = rule.check(op, real, ins)
            if summary is not None:
                return rule.cause, summary
    return "unclassified", ""


def argument_names(op: str) -> list[str]:
    """The names of an op's inputs, in order (``["a", "x"]`` for ``Igamma``), from ``tf.raw_ops``."""
    import inspect  # noqa: PLC0415

    import tensorflow as tf  # noqa: PLC0415 - the rules read NumPy values; only this asks TensorFlow

    function = getattr(tf.raw_ops, op, None)
    if function is None:
        return []
    try:
        return [name for name in inspect.signature(function).parameters if name != "name"]
    except (TypeError, ValueError):
        return []


def _gradient_argument(event) -> str:
    """``"; at argument 2 (x) of Igamma ..."``: the forward op's input that the failing gradient op read."""
    forward = event.forward
    if forward is None or not event.record.inputs:
        return f", inside TensorFlow's gradient of {event.forward_type}"
    inner = _as_float(event.record.inputs[0])
    names = argument_names(forward.op_type)
    for index, array in enumerate(forward.inputs):
        array = _as_float(array)
        if array is None or inner is None or np.shape(array) != np.shape(inner):
            continue
        if np.array_equal(array, inner, equal_nan=True):
            name = f" ({names[index]})" if index < len(names) else ""
            return (f", inside TensorFlow's gradient of {forward.op_type}: argument {index + 1}{name} of "
                    f"{forward.op_type}")
    return f", inside TensorFlow's gradient of {forward.op_type}"


def _in_float64(op: str, inputs: Sequence) -> np.ndarray | None:
    """The op's first output recomputed from the same inputs in float64, or ``None`` if it cannot be."""
    import tensorflow as tf  # noqa: PLC0415

    names = argument_names(op)
    if not names or len(inputs) > len(names) or any(a is None or np.iscomplexobj(a) for a in inputs):
        return None
    try:
        value = getattr(tf.raw_ops, op)(**{n: tf.constant(np.asarray(a, np.float64)) for n, a in zip(names, inputs)})
        value = value[0] if isinstance(value, (list, tuple)) else value
        return np.asarray(value.numpy(), np.float64)
    except Exception:  # noqa: BLE001 - an op without a float64 kernel, or with attributes to give
        return None


def _beyond_range(op: str, inputs: Sequence, output: np.ndarray) -> tuple[str, str] | None:
    """What the same op computes in float64 where it was not finite: beyond the dtype's range, or not a number.

    An infinite output from finite inputs is an overflow only if the true value is
    finite and too large for the dtype (``lgamma``, ``exp``, ``pow``, a Bessel function
    of a large argument); a pole or an edge of the domain (``log`` of 0, ``ndtri`` of 1)
    is infinite or NaN at any precision.
    """
    if output.dtype.kind != "f" or output.dtype.itemsize >= 8:
        return None
    exact = _in_float64(op, inputs)
    if exact is None or exact.shape != output.shape:
        return None
    bad = ~np.isfinite(np.asarray(output, np.float64))
    limit = float(np.finfo(output.dtype).max)
    values = exact[bad]
    too_large = np.isfinite(values) & (np.abs(values) > limit)
    if too_large.any() and not np.isnan(values).any():  # the rest beyond float64's range as well
        return "overflow", (f"{_count(bad)} of {output.size} outputs of {op} are beyond {output.dtype}'s max "
                            f"{limit:.5g}: up to {float(np.max(np.abs(values[too_large]))):.3g} in float64")
    if not np.isfinite(values).any():
        what = "NaN" if np.isnan(values).all() else "infinite"
        return "domain_edge", (f"{op} made {_count(bad)} of {output.size} values non-finite from finite inputs, "
                               f"{what} in float64 as well (a pole or the edge of its domain)")
    return None


def _output_cause(op: str, inputs: Sequence, event) -> tuple[str, str]:
    """The cause seen from what the op made of its inputs: overflow, 0*Inf, Inf-Inf."""
    ins = [_as_float(a) for a in inputs]
    bad_inputs = [(i, a) for i, a in enumerate(ins) if a is not None and a.size and not _finite(a).all()]
    output = next((o for o in event.outputs if o is not None and o.size and not _finite(o).all()), None)
    if bad_inputs and output is not None and op in ROW_OPS and np.ndim(output) >= 1:
        rows = _row_summary(op, bad_inputs[0][1], output)
        if rows:
            return "inf_arithmetic", rows
    if bad_inputs:
        index, array = bad_inputs[0]
        share = f"{_count(~_finite(array))} of {array.size} entries of input {index} of {op} are not finite"
        multiplies = op in ("Mul", "MatMul", "BatchMatMulV2", "Einsum")
        if multiplies and any(a is not None and a.size and (a == 0).any() for a in ins):
            return "inf_arithmetic", f"{op} multiplies 0 by Inf: {share}"
        return "inf_arithmetic", share
    if output is not None and not np.iscomplexobj(output):
        exact = _beyond_range(op, ins, output)
        if exact is not None:  # what the values did, at a precision that holds them
            return exact
        out = np.asarray(output, np.float64)
        if np.isinf(out).any() and (op in OVERFLOW_OPS or event.backward):
            finfo = np.finfo(output.dtype) if output.dtype.kind == "f" else None
            magnitudes = [float(np.max(np.abs(a))) for a in ins if a is not None and a.size and not np.iscomplexobj(a)]
            largest = max(magnitudes, default=float("nan"))
            limit = f"{float(finfo.max):.5g}" if finfo is not None else "the dtype's max"
            return "overflow", (
                f"{_count(np.isinf(out))} of {out.size} outputs of {op} exceed {output.dtype}'s max {limit}; "
                f"largest |input| {largest:.3g}"
            )
    if output is not None:
        count = _count(~_finite(output))
        return "domain_edge", f"{op} made {count} of {output.size} values non-finite from finite inputs"
    return "unclassified", ""


#: Ops that reduce or normalise along their last axis: a non-finite output is reported
#: by its rows (a fully masked attention row), not by counting masked inputs.
ROW_OPS = frozenset({"Softmax", "LogSoftmax", "Max", "Min", "Sum", "Mean", "Prod", "Logsumexp"})


def _shown(indices) -> str:
    indices = [str(i) for i in indices]
    return ", ".join(indices[:5]) + (", ..." if len(indices) > 5 else "")


def _row_summary(op: str, array, output) -> str:
    """Which rows (slices along the last axis) of a masked or reduced op are non-finite."""
    out = ~_finite(output)
    if op in ("Softmax", "LogSoftmax") and np.shape(array) == np.shape(output) and np.ndim(output) >= 1:
        values = np.asarray(array)
        flat_in = values.reshape(-1, values.shape[-1])
        bad_rows = np.nonzero(out.reshape(-1, out.shape[-1]).any(axis=1))[0]
        masked = np.isneginf(flat_in)
        full = [int(r) for r in bad_rows if masked[r].all()]
        index = [tuple(int(i) for i in np.unravel_index(r, values.shape[:-1])) if values.ndim > 1 else () for r in bad_rows]
        where = _shown(i[0] if len(i) == 1 else i for i in index) if index and index[0] != () else "the only row"
        text = f"{len(bad_rows)} of {flat_in.shape[0]} rows of {op} are non-finite ({where})"
        if full and len(full) == len(bad_rows):
            text += ": every input of each is -inf (a fully masked row: -inf - max = NaN)"
        elif full:
            text += f"; {len(full)} of them are fully masked (every input -inf)"
        finite_rows = flat_in.shape[0] - len(bad_rows)
        if finite_rows and masked.any():
            text += f"; the other {finite_rows} rows' -inf entries are masked as intended"
        return text
    if np.ndim(output) >= 1 and out.any():
        index = np.argwhere(out)
        shown = _shown(tuple(int(v) for v in i) if len(i) > 1 else int(i[0]) for i in index)
        return f"{int(out.sum())} of {out.size} outputs of {op} are non-finite (at {shown})"
    return ""


#: A noisy run "grew" when the median of its last tenth of losses is this many times the
#: median of its first tenth (a loop that bootstraps its targets, a rate too large for a
#: noisy loss: no three losses in a row rise, and the run still climbs by orders).
TREND_GROWTH = 100.0


def grew(losses: Sequence[float]) -> bool:
    """Whether finite losses grew before the end: step after step, or by orders over the run.

    Step after step: the last three rose, the last over 10 times the smallest. Over the
    run (at least 20 losses, noisy as reinforcement learning's are): the median of the
    last tenth is :data:`TREND_GROWTH` times the median of the first tenth.
    """
    finite = [float(v) for v in losses if np.isfinite(v)]
    if len(finite) < 3:
        return False
    tail = finite[-3:]
    tiny = np.finfo(np.float32).tiny
    if tail[0] <= tail[1] <= tail[2] and tail[2] > 10 * max(min(finite), tiny):
        return True
    if len(finite) >= 20:
        tenth = max(2, len(finite) // 10)
        first, last = float(np.median(np.abs(finite[:tenth]))), float(np.median(np.abs(finite[-tenth:])))
        return last > TREND_GROWTH * max(first, tiny)
    return False


# --- causes read from the run: the learning rate, targets made from the model's outputs -----

#: A schedule "grew" when its rate at the failing step is this many times the median of
#: its positive rates over the steps before it (a warmup to a peak is about 2 times).
RATE_GROWTH = 10.0

#: Causes a learning rate or bootstrapped targets can lie behind: values that overflowed.
GROWTH_CAUSES = frozenset({"divergence", "overflow", "inf_arithmetic", "nonfinite_weights", "unclassified",
                           "domain_edge"})


def rate_cause(rates: Sequence[float], first_step: int = 0) -> str | None:
    """What the learning rates of the steps up to the failing one (``rates[-1]``) did wrong, or ``None``.

    ``rates[i]`` is the rate of step ``first_step + i``.

    The rate at the failing step is 0 or below (gradient descent then climbs the loss,
    or stands still), or it is :data:`RATE_GROWTH` times the median of the positive
    rates before it and still growing (a schedule that explodes: ``decay_rate`` above 1),
    or it rose at every step of the second half and is 1.5 times its value half-way (a
    warmup that does not end). Called only for values that overflowed
    (:data:`GROWTH_CAUSES`).
    """
    rates = [float(r) for r in rates]
    if not rates or not np.isfinite(rates[-1]):
        return None if not rates else f"the learning rate at the failing step is {rates[-1]}"
    last = rates[-1]
    if last <= 0 and len(rates) == 1:  # a rate, not a schedule: its value now is all there is
        return f"the learning rate at the failing step is {last:.3g}"
    if last <= 0:
        first_bad = next(i for i, r in enumerate(rates) if r <= 0)
        peak = max(rates)
        since = (f"; it fell to 0 or below at step {first_step + first_bad} (peak {peak:.3g})"
                 if len(rates) > 1 and peak > 0 else "")
        return f"the learning rate at the failing step (step {first_step + len(rates) - 1}) is {last:.3g}{since}"
    positive = [r for r in rates[:-1] if r > 0]
    if len(positive) >= 2 and last >= RATE_GROWTH * float(np.median(positive)) and last >= rates[-2]:
        return (f"the learning rate at the failing step (step {first_step + len(rates) - 1}) is {last:.3g}, "
                f"{last / float(np.median(positive)):.3g} times the median of the steps before it "
                f"({float(np.median(positive)):.3g}) and still growing")
    half = len(rates) // 2
    if len(rates) >= 8 and rates[half] > 0 and last >= 1.5 * rates[half] and all(
            b >= a for a, b in zip(rates[half:], rates[half + 1:])):
        return (f"the learning rate rose step after step to {last:.3g} at the failing step "
                f"(step {first_step + len(rates) - 1}; {rates[half]:.3g} at step {first_step + half}): the "
                "weights grew as it rose (a warmup that does not end)")
    return None


def bootstrapped(y_true, y_pred) -> str | None:
    """Whether targets were computed from the model's own outputs and grew with them, as a summary; else ``None``.

    From the values at the failing step: the targets are as large as the model's own
    outputs on the same inputs (the median ratio of their magnitudes within a factor of
    2, or most entries equal, as Q-learning's targets copy every output but the action
    taken) and beyond the fourth root of the dtype's largest value (1.8e9 for float32:
    no scaled target is that large), or non-finite where the outputs are.
    """
    try:
        y = np.asarray(y_true, np.float64)
        p = np.asarray(y_pred, np.float64)
    except (TypeError, ValueError):
        return None
    if y.shape != p.shape or not y.size:
        return None
    limit = float(np.finfo(np.float32).max) ** 0.25
    both = np.isfinite(y) & np.isfinite(p)
    same_bad = ~np.isfinite(y) & ~np.isfinite(p)
    if both.any():
        big = max(float(np.max(np.abs(y[both]))), float(np.max(np.abs(p[both]))))
        equal = float(np.mean(np.isclose(y, p, rtol=1e-3) | same_bad))
        nonzero = both & (p != 0) & (y != 0)
        ratio = float(np.median(np.abs(y[nonzero] / p[nonzero]))) if nonzero.any() else float("nan")
        alike = equal >= 0.5 or 0.5 <= ratio <= 2.0
        if big >= limit and alike:
            return (f"the targets reach {float(np.max(np.abs(y[np.isfinite(y)]))):.3g} and the model's own "
                    f"outputs on the same inputs {float(np.max(np.abs(p[both]))):.3g}: "
                    + (f"{equal:.0%} of the targets equal the outputs" if equal >= 0.5
                       else f"the targets are {ratio:.3g} times the outputs")
                    + " (targets made from the model's own outputs grow with them)")
    if same_bad.any() and same_bad.sum() == (~np.isfinite(y)).sum():
        return (f"{int(same_bad.sum())} of {y.size} targets are non-finite exactly where the model's own outputs "
                "on the same inputs are (targets made from the model's own outputs)")
    return None
