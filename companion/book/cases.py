"""The NaN-gradient checklist's cases: one small case per row of the checklist.

:data:`CASES` holds one :class:`Case` per row of the book's checklist chapter
(``book/closing/checklist.ipynb``): a point, the naive computation that fails there, and
the fix. :func:`check_case` evaluates both and their gradients at the point; the tests
assert that the naive form is not finite and the fix is. The rows themselves come from the
survey of public reports, :mod:`companion.book.survey`.

Two rows are runs rather than functions: :func:`diverging_fit` (a learning rate that is
too large) and :func:`loss_scaling_run` (a ``float16`` backward pass under a fixed loss
scale, against Keras' dynamic ``LossScaleOptimizer``).

Part of the book's support code (:mod:`companion.book`): no stability promise.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from companion.numerics import double_where, signed_pow

__all__ = [
    "CASES",
    "Case",
    "CaseResult",
    "case_model",
    "check_case",
    "diverging_fit",
    "doctor_run",
    "first_nonfinite",
    "fixed_loss_scale_diagnosis",
    "loss_scaling_run",
    "naive_standardize",
    "toy_model",
]


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the checklist: a point where a naive computation fails, and its fix.

    Attributes:
        name: short name of the row.
        pattern: the survey pattern it stands for, a key of :data:`companion.book.survey.PATTERNS`.
        cause: the cause the NaN doctor names for the naive form (a name of
            ``companion.diagnostics.CAUSES``).
        point: the input, a list of floats (``float32``; ``float16`` for the
            ``float16`` row).
        naive: the computation as it is usually written, a function of one tensor
            returning a scalar.
        fix_name: what the fix is, in a few words.
        fix: the fixed computation, the same function where the naive one is finite.
        dtype: the point's dtype, ``"float32"`` unless said.
    """

    name: str
    pattern: str
    cause: str
    point: tuple[float, ...]
    naive: Callable[[tf.Tensor], tf.Tensor]
    fix_name: str
    fix: Callable[[tf.Tensor], tf.Tensor]
    dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """What :func:`check_case` measured: finiteness of value and gradient, naive and fixed.

    Attributes:
        value: the naive value is finite.
        gradient: the naive gradient is finite (every entry).
        fixed_value: the fixed value is finite.
        fixed_gradient: the fixed gradient is finite.
    """

    value: bool
    gradient: bool
    fixed_value: bool
    fixed_gradient: bool


def _finite(tensor) -> bool:
    return bool(np.all(np.isfinite(tf.cast(tensor, tf.float32).numpy())))


def check_case(case: Case) -> CaseResult:
    """Evaluate a case's naive and fixed forms and their gradients at its point.

    Args:
        case: a :class:`Case`, e.g. ``CASES["norm at 0"]``.

    Returns:
        A :class:`CaseResult` of four booleans.

    Example:
        >>> check_case(CASES["norm at 0"])
        CaseResult(value=True, gradient=False, fixed_value=True, fixed_gradient=True)
    """
    point = tf.constant(case.point, dtype=case.dtype)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(point)
        naive, fixed = case.naive(point), case.fix(point)
    return CaseResult(
        _finite(naive), _finite(tape.gradient(naive, point)), _finite(fixed), _finite(tape.gradient(fixed, point))
    )


def _squared_norm(v):
    return tf.reduce_sum(v * v)


def _atan2_zero_at_origin(y, x):
    # atan2's gradient is (x, -y) / (x^2 + y^2): 0/0 at the origin. Replace the origin by
    # (0, 1) before atan2 and select 0 there: value 0, gradient 0, as torch now does.
    at_origin = tf.equal(x * x + y * y, 0.0)
    angle = tf.math.atan2(tf.where(at_origin, 0.0, y), tf.where(at_origin, 1.0, x))
    return tf.where(at_origin, tf.zeros_like(angle), angle)


def _open_interval(v):
    # acos and asin have infinite derivatives at ±1: clip into the open interval.
    bound = 1.0 - float(np.finfo(v.dtype.as_numpy_dtype).eps)
    return tf.clip_by_value(v, -bound, bound)


def _one_hot_second(v):
    return tf.constant([0.0, 1.0], v.dtype)


def _standardized_first(v, eps: float = 0.0):
    mean, variance = tf.nn.moments(v, axes=[0])
    return ((v - mean) / tf.sqrt(variance + eps))[0]


def _squared_deviations(v):
    return tf.reduce_sum(tf.square(v - tf.reduce_mean(v)))


def _bessel_denominator(v):
    # n - 1, Bessel's correction: 0 for a single sample.
    return tf.cast(tf.size(v), v.dtype) - 1.0


def _log_floor(v):
    # The smallest normal number of the dtype: log of it is finite (-87.3 in float32).
    return tf.math.log(tf.maximum(v, float(np.finfo(v.dtype.as_numpy_dtype).tiny)))


_CASE_LIST = [
    Case("norm at 0", "norm_at_zero", "singular_derivative", (0.0, 0.0), tf.norm,
         "double_where", lambda v: double_where(_squared_norm(v) > 0, tf.sqrt, _squared_norm(v), 0.0)),
    Case("p log p at p = 0", "crossentropy_probabilities", "log_of_zero", (0.0, 0.5),
         lambda p: tf.reduce_sum(p * tf.math.log(p)), "tf.math.xlogy", lambda p: tf.reduce_sum(tf.math.xlogy(p, p))),
    Case("logsumexp of (100, 0)", "softplus_logsigmoid", "overflow", (100.0, 0.0),
         lambda s: tf.math.log(tf.reduce_sum(tf.exp(s))), "tf.reduce_logsumexp", tf.reduce_logsumexp),
    # exp(100) overflows, but 1/inf = 0 keeps the value finite: the doctor finds inf/inf
    # in the gradient of the division.
    Case("softmax of (100, 0)", "softplus_logsigmoid", "inf_arithmetic", (100.0, 0.0),
         lambda s: (tf.exp(s) / tf.reduce_sum(tf.exp(s)))[1], "tf.nn.softmax", lambda s: tf.nn.softmax(s)[1]),
    Case("x / (x + y) at 0, 0", "division", "division_by_zero", (0.0, 0.0), lambda v: v[0] / (v[0] + v[1]),
         "tf.math.divide_no_nan", lambda v: tf.math.divide_no_nan(v[0], v[0] + v[1])),
    Case("float16 300 ** 2", "float16_range", "overflow", (300.0,), lambda v: tf.reduce_sum(tf.square(v)),
         "square in float32", lambda v: tf.reduce_sum(tf.square(tf.cast(v, tf.float32))), dtype="float16"),
    Case("acos at 1", "acos_asin", "singular_derivative", (1.0,), lambda v: tf.reduce_sum(tf.math.acos(v)),
         "clip into (-1, 1)", lambda v: tf.reduce_sum(tf.math.acos(_open_interval(v)))),
    Case("asin at -1", "acos_asin", "singular_derivative", (-1.0,), lambda v: tf.reduce_sum(tf.math.asin(v)),
         "clip into (-1, 1)", lambda v: tf.reduce_sum(tf.math.asin(_open_interval(v)))),
    Case("atan2 at (0, 0)", "atan2_angle", "singular_derivative", (0.0, 0.0), lambda v: tf.math.atan2(v[0], v[1]),
         "where at the origin", lambda v: _atan2_zero_at_origin(v[0], v[1])),
    Case("angle of 0 + 0i", "atan2_angle", "singular_derivative", (0.0, 0.0),
         lambda v: tf.math.angle(tf.complex(v[0], v[1])), "atan2, where at 0", lambda v: _atan2_zero_at_origin(v[1], v[0])),
    Case("cross-entropy of softmax(100, 0)", "crossentropy_probabilities", "log_of_zero", (100.0, 0.0),
         lambda s: -tf.reduce_sum(_one_hot_second(s) * tf.math.log(tf.nn.softmax(s))),
         "from logits", lambda s: tf.nn.softmax_cross_entropy_with_logits(_one_hot_second(s), s)),
    Case("reduce_std of (2, 2, 2)", "reduce_std", "singular_derivative", (2.0, 2.0, 2.0), tf.math.reduce_std,
         "double_where", lambda v: double_where(tf.math.reduce_variance(v) > 0, tf.sqrt, tf.math.reduce_variance(v))),
    Case("standardize (5, 5, 5)", "zero_variance_norm", "division_by_zero", (5.0, 5.0, 5.0), _standardized_first,
         "epsilon in the sqrt", lambda v: _standardized_first(v, eps=1e-3)),
    Case("cosine of (0, 0) and (1, 2)", "cosine_zero_vector", "division_by_zero", (0.0, 0.0),
         lambda u: tf.reduce_sum(u * [1.0, 2.0]) / (tf.norm(u) * tf.norm([1.0, 2.0])),
         "l2_normalize", lambda u: tf.reduce_sum(tf.nn.l2_normalize(u) * tf.nn.l2_normalize([1.0, 2.0]))),
    Case("log(1 + exp(100))", "softplus_logsigmoid", "overflow", (100.0,),
         lambda x: tf.reduce_sum(tf.math.log(1.0 + tf.exp(x))), "tf.nn.softplus", lambda x: tf.reduce_sum(tf.nn.softplus(x))),
    Case("log(sigmoid(-200))", "softplus_logsigmoid", "log_of_zero", (-200.0,),
         lambda x: tf.reduce_sum(tf.math.log(tf.sigmoid(x))), "tf.math.log_sigmoid", lambda x: tf.reduce_sum(tf.math.log_sigmoid(x))),
    Case("where(x > 0, log(x), 0) at 0", "where_trap", "where_trap", (0.0, 1.0),
         lambda x: tf.reduce_sum(tf.where(x > 0, tf.math.log(x), 0.0)), "double_where",
         lambda x: tf.reduce_sum(double_where(x > 0, tf.math.log, x, 0.0))),
    Case("(-8) ** (1/3)", "pow_negative_base", "pow_negative_base", (-8.0,), lambda x: tf.reduce_sum(tf.pow(x, 1 / 3)),
         "signed_pow", lambda x: tf.reduce_sum(signed_pow(x, 1 / 3))),
    Case("log at 0", "log_at_zero", "log_of_zero", (0.0, 1.0), lambda x: tf.reduce_sum(tf.math.log(x)),
         "log(max(x, tiny))", lambda x: tf.reduce_sum(_log_floor(x))),
    Case("sqrt of -1", "sqrt_of_negative", "domain_edge", (-1.0, 4.0), lambda x: tf.reduce_sum(tf.sqrt(x)),
         "double_where at 0", lambda x: tf.reduce_sum(double_where(x > 0, tf.sqrt, x, 0.0))),
    Case("exp(100)", "exp_overflow", "overflow", (100.0,), lambda x: tf.reduce_sum(tf.exp(x)),
         "clip the exponent", lambda x: tf.reduce_sum(tf.exp(tf.minimum(x, 80.0)))),
    Case("unbiased variance of (3)", "single_sample_variance", "division_by_zero", (3.0,),
         lambda v: _squared_deviations(v) / _bessel_denominator(v), "tf.math.divide_no_nan",
         lambda v: tf.math.divide_no_nan(_squared_deviations(v), _bessel_denominator(v))),
]

#: The checklist's cases by name, in the order the chapter shows them.
CASES: dict[str, Case] = {case.name: case for case in _CASE_LIST}


def naive_standardize(x) -> tf.Tensor:
    """``(x - mean) / sqrt(mean(x^2) - mean^2)``: the one-pass standardisation, as often written.

    In ``float16`` the square of values around 300 overflows (``300^2 > 65504``) and
    ``inf - inf`` makes every entry NaN; compute it in ``float32`` instead.

    Args:
        x: a floating-point tensor.

    Returns:
        ``x`` standardised over all its entries, in ``x``'s dtype.

    Example:
        >>> naive_standardize(tf.constant([1.0, 3.0])).numpy()
        array([-1.,  1.], dtype=float32)
    """
    x = tf.convert_to_tensor(x)
    mean = tf.reduce_mean(x)
    variance = tf.reduce_mean(tf.square(x)) - tf.square(mean)
    return (x - mean) / tf.sqrt(variance)


def case_model(case: Case) -> keras.Model:
    """A model whose forward pass is ``case.naive`` at ``case.point``, for the NaN doctor.

    An identity ``Dense`` layer (named ``dense``, so there are variables to differentiate)
    feeds a ``Lambda`` layer named after the case's pattern that applies ``case.naive``
    to the one example of the batch.

    Args:
        case: a :class:`Case`.

    Returns:
        An uncompiled ``keras.Model`` mapping inputs of shape ``(1, len(case.point))``
        to an output of shape ``(1, 1)``.

    Example:
        >>> case = CASES["norm at 0"]
        >>> model = case_model(case)
        >>> model(np.array([case.point], np.float32)).numpy()
        array([[0.]], dtype=float32)
    """
    size = len(case.point)
    naive, dtype = case.naive, case.dtype

    def forward(z):
        return tf.cast(tf.reshape(naive(tf.cast(z[0], dtype)), (1, 1)), tf.float32)

    return keras.Sequential(
        [
            keras.Input((size,)),
            keras.layers.Dense(size, kernel_initializer="identity", name="dense"),
            keras.layers.Lambda(forward, name=case.pattern),
        ],
        name="case",
    )


def doctor_run(case: Case):
    """The NaN doctor on a case: :func:`companion.diagnostics.diagnose` of :func:`case_model`.

    The loss is the model's output itself (the mean over the batch of one), so the
    gradient the doctor follows is the case's own gradient.

    Args:
        case: a :class:`Case`.

    Returns:
        The :class:`~companion.diagnostics.Diagnosis` (None if nothing was non-finite).

    Example:
        >>> doctor_run(CASES["(-8) ** (1/3)"]).cause
        'pow_negative_base'
    """
    from companion.diagnostics import diagnose

    x = np.array([case.point], np.float32)
    return diagnose(case_model(case), (x, np.zeros((1, 1), np.float32)), loss=lambda y, p: tf.reduce_mean(p))


# --- the two runs -----------------------------------------------------------------------


def toy_model(root: Callable[[tf.Tensor], tf.Tensor] | None = None, name: str = "toy") -> keras.Model:
    """The checklist's toy model: ``ŷ = root(w x + c)`` with ``w = 1``, ``c = 0``.

    Args:
        root: the function after the Dense layer; default ``tf.pow(z, 0.5)``, whose
            gradient at ``z = 0`` has case A's ``0 · ∞``.
        name: the model's name (the variables are ``name/dense/kernel`` and
            ``name/dense/bias``).

    Returns:
        An uncompiled ``keras.Sequential`` of a ``Dense(1)`` layer named ``dense`` and a
        ``Lambda`` layer named ``root``, for inputs of shape ``(batch, 1)``.

    Example:
        >>> toy_model()(np.array([[4.0]], np.float32)).numpy()
        array([[2.]], dtype=float32)
    """
    root = root or (lambda z: tf.pow(z, 0.5))
    return keras.Sequential(
        [
            keras.Input((1,)),
            keras.layers.Dense(1, kernel_initializer="ones", name="dense"),
            keras.layers.Lambda(root, name="root"),
        ],
        name=name,
    )


def _regression_data(n: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32) * 3.0
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
    return x, y


def diverging_fit(learning_rate: float, steps: int = 40, clipnorm: float | None = None) -> list[float]:
    """Plain SGD on a linear regression, one full batch a step; the loss after each step.

    With inputs of standard deviation 3, the mean-squared loss has curvature about 18 per
    weight, so SGD diverges once the learning rate exceeds about ``2 / 18 ≈ 0.1``: the
    loss grows geometrically, overflows to ``inf`` and then to ``nan``. A smaller rate,
    or ``clipnorm``, keeps it finite.

    Args:
        learning_rate: the SGD learning rate.
        steps: how many steps to run.
        clipnorm: passed to ``keras.optimizers.SGD`` (clip each gradient to this norm).

    Returns:
        The loss (a Python float, possibly ``inf`` or ``nan``) after each step.

    Example:
        >>> losses = diverging_fit(0.01, steps=5)
        >>> losses[-1] < losses[0]
        True
    """
    x, y = _regression_data()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="zeros")])
    optimizer = keras.optimizers.SGD(learning_rate, clipnorm=clipnorm)
    losses = []
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(gradients, model.trainable_variables)
        losses.append(float(tf.reduce_mean(tf.square(model(x) - y))))
    return losses


def loss_scaling_run(dynamic: bool, steps: int = 6, scale: float = 2.0**15) -> dict[str, list]:
    """A ``float16`` backward pass under a fixed loss scale, or Keras' dynamic one.

    The model is a ``Dense(1)`` under the ``mixed_float16`` policy, fitted to targets of
    about 100, so the gradient of the loss with respect to the ``float16`` output is
    about 200 per example; multiplied by a fixed loss scale of ``2**15`` it exceeds
    ``float16``'s 65504 and becomes ``inf``. Unscaled, that update makes the weights
    ``nan``. Keras' ``LossScaleOptimizer`` (what :func:`companion.training.train` uses for
    a ``mixed_float16`` model) checks the scaled gradients, skips such a step and halves
    the scale until the gradients fit.

    Args:
        dynamic: True for ``keras.optimizers.LossScaleOptimizer(SGD, initial_scale=scale)``,
            False for the same fixed scale applied by hand.
        steps: how many steps to run.
        scale: the (initial) loss scale.

    Returns:
        A dict with ``"weights_finite"`` (bool after each step), ``"loss"`` (float after
        each step) and ``"scale"`` (the loss scale after each step).

    Example:
        >>> run = loss_scaling_run(dynamic=False, steps=1)
        >>> run["weights_finite"]
        [False]
    """
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        x = np.linspace(-1.0, 1.0, 32, dtype=np.float32).reshape(-1, 1)
        y = 100.0 + 10.0 * x
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="zeros")])
        inner = keras.optimizers.SGD(1e-3)
        optimizer = keras.optimizers.LossScaleOptimizer(inner, initial_scale=scale) if dynamic else inner
        record: dict[str, list] = {"weights_finite": [], "loss": [], "scale": []}
        for _ in range(steps):
            with tf.GradientTape() as tape:
                prediction = model(x)
                loss = tf.reduce_mean(tf.square(tf.cast(prediction, tf.float32) - y))
                scaled = optimizer.scale_loss(loss) if dynamic else loss * scale
            gradients = tape.gradient(scaled, model.trainable_variables)
            if not dynamic:
                gradients = [g / scale for g in gradients]
            optimizer.apply(gradients, model.trainable_variables)
            record["weights_finite"].append(all(_finite(v) for v in model.trainable_variables))
            record["loss"].append(float(tf.reduce_mean(tf.square(tf.cast(model(x), tf.float32) - y))))
            record["scale"].append(float(optimizer.scale_loss(1.0)) if dynamic else scale)
        return record
    finally:
        keras.mixed_precision.set_global_policy(previous)


def fixed_loss_scale_diagnosis(scale: float = 2.0**15):
    """The NaN doctor on :func:`loss_scaling_run`'s model with a fixed loss scale.

    The loss is the mean squared error multiplied by ``scale``, as a fixed loss scale
    computes it; the doctor finds the ``float16`` gradient that overflows.

    Args:
        scale: the fixed loss scale.

    Returns:
        The :class:`~companion.diagnostics.Diagnosis` of the first batch.

    Example:
        >>> d = fixed_loss_scale_diagnosis()
        >>> d.cause, d.phase, d.dtype
        ('overflow', 'backward', 'float16')
    """
    from companion.diagnostics import diagnose

    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        x = np.linspace(-1.0, 1.0, 32, dtype=np.float32).reshape(-1, 1)
        y = 100.0 + 10.0 * x
        model = keras.Sequential(
            [keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="zeros", name="dense")], name="scaled"
        )

        def scaled_loss(y_true, y_pred):
            return scale * tf.reduce_mean(tf.square(tf.cast(y_pred, tf.float32) - y_true))

        return diagnose(model, (x, y), loss=scaled_loss)
    finally:
        keras.mixed_precision.set_global_policy(previous)


def first_nonfinite(values) -> int | None:
    """The 1-based index of the first value that is not finite, or None.

    Example:
        >>> first_nonfinite([1.0, 2.0, float("inf"), float("nan")])
        3
    """
    for index, value in enumerate(values, 1):
        if not math.isfinite(value):
            return index
    return None

