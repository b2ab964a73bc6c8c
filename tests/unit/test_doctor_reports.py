"""The NaN doctor on failures rebuilt from public bug reports.

Each case rebuilds, on a tiny model, a NaN that someone reported publicly (the URL is
in the case), and runs it the way its reporter ran it: a custom eager loop
(``eager``), a ``tf.function`` loop (``function``), an XLA-compiled loop (``xla``),
``model.fit`` on arrays or on a dataset with the :class:`NaNDoctor` callback
(``fit_arrays``, ``fit_dataset``), a model compiled with ``jit_compile=True`` handed
to :func:`diagnose` (``compiled_xla``), or any of them under the ``mixed_float16``
policy (``mixed``). In every mode the test asserts the cause, the op (and, for a
gradient op, the forward op), the layer and the line that the doctor names. The line
is the one marked ``# <- case`` in this file.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf

from companion.diagnostics import CAUSES, NaNDoctor, diagnose, diagnose_function

HERE = inspect.getsourcefile(lambda: None)
with open(HERE) as _source:
    _LINES = _source.read().splitlines()


def marked(case_id: str) -> int:
    """The line of this file that carries the marker of ``case_id``."""
    marker = f"# <- {case_id}"
    (found,) = [i + 1 for i, line in enumerate(_LINES) if line.rstrip().endswith(marker)]
    return found


@dataclasses.dataclass
class Case:
    id: str
    url: str
    build: Callable  # () -> (model, x, y, loss)
    cause: str
    op: str | None
    forward_op: str | None
    layer: str | None
    modes: tuple[str, ...]
    line: bool = True  # whether the doctor must name the marked line


# --------------------------------------------------------------------------------------
# Small layers the cases are built from
# --------------------------------------------------------------------------------------


def weighted(name: str, fn: Callable, init: float = 1.0) -> keras.layers.Layer:
    """A layer with one scalar weight w that returns fn(w, x)."""

    class Weighted(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(), initializer=keras.initializers.Constant(init), name="w")

        def call(self, x):
            return fn(self.w, x)

    return Weighted(name=name)


def net(*layers, features: int = 1) -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((features,)), *layers], name="net")


def ones(n: int = 4, features: int = 1) -> np.ndarray:
    return np.ones((n, features), "float32")


def mse(y, p):
    return tf.reduce_mean(tf.square(y - p))


# --------------------------------------------------------------------------------------
# The cases (the marked line is where the doctor must point)
# --------------------------------------------------------------------------------------


def sqrt_of_product():
    # A tf.sqrt(c * x) term whose constant c is sometimes 0.
    layer = weighted("sqrt_cx", lambda w, x: tf.sqrt(w * x))  # <- sqrt_of_product
    x = ones()
    x[1] = 0.0
    return net(layer), x, ones(), mse


def norm_of_difference():
    # ||x - c|| as a feature: the gradient of the norm is x / ||x|| = 0/0 at x = c.
    layer = weighted("dist", lambda w, x: tf.sqrt(tf.reduce_sum(tf.square(x - w), 1, keepdims=True)))  # <- norm_of_difference
    x = ones()
    return net(layer), x, ones() * 2, mse


def norm_of_relu():
    # 0.5 * ||relu(w x)||^2 where every unit is off: the norm's sqrt at 0.
    def fn(w, x):
        r = tf.nn.relu(w * x)
        return tf.sqrt(tf.reduce_sum(tf.square(r), 1, keepdims=True)) + r  # <- norm_of_relu

    return net(weighted("relu_norm", fn)), -ones(), ones(), mse


def triplet_distance():
    # Triplet loss on identical anchor and positive: sqrt of a squared distance of 0.
    def loss(y, p):
        d = tf.reduce_sum(tf.square(p - y), axis=1)
        return tf.reduce_mean(tf.maximum(tf.sqrt(d) + 0.5, 0.0))  # <- triplet_distance

    model = net(keras.layers.Dense(1, kernel_initializer="zeros", bias_initializer="zeros", name="embed"))
    return model, ones(), np.zeros((4, 1), "float32"), loss


def keras_normalize_zero_vector():
    # keras.ops.normalize of a zero vector: the L2 fast path's rsqrt(0) = Inf. Eagerly
    # and in a graph the gradient is 0; compiled with XLA it is NaN.
    def fn(w, x):
        return keras.ops.normalize(w * x, axis=-1, order=2)  # <- keras_normalize_zero_vector

    return net(weighted("unit", fn), features=2), np.zeros((4, 2), "float32"), ones(4, 2), mse


def where_log():
    def loss(y, p):
        return tf.reduce_mean(tf.where(p > 0, -tf.math.log(p), tf.zeros_like(p)))  # <- where_log

    x = ones()
    x[2] = 0.0
    return net(weighted("scale", lambda w, x: w * x)), x, ones(), loss


def where_exp_overflow():
    # tf.select(x > 0, 0, exp(x)) at x = 1e10: the exp of the unselected branch is Inf.
    def fn(w, x):
        return tf.where(w * x > 0, tf.zeros_like(x), tf.exp(w * x))  # <- where_exp_overflow

    return net(weighted("gate", fn)), ones() * 1e10, ones(), mse


def where_pow_exp():
    # tf.where(a < 15, a, 10 ** exp(a)): the unselected branch overflows.
    def fn(w, x):
        a = w * x
        return tf.where(a < 15.0, a, tf.pow(10.0, tf.exp(a)))  # <- where_pow_exp

    return net(weighted("branch", fn, init=10.0)), ones(), ones(), mse


def where_reciprocal():
    # transfer = where(x < 0, 1 / (1 - x), log(x + 1)) at x = -1: log(0) unselected.
    def fn(w, x):
        z = w * x
        return tf.where(z < 0, 1.0 / (1.0 - z), tf.math.log(z + 1.0))  # <- where_reciprocal

    return net(weighted("transfer", fn)), -ones(), ones(), mse


def acos_of_clipped_cosine():
    def fn(w, x):
        cosine = tf.clip_by_value(w * x, -1.0, 1.0)
        return tf.acos(cosine)  # <- acos_of_clipped_cosine

    return net(weighted("angle", fn)), ones(), ones(), mse


def complex_angle():
    # An angle-based loss on a complex output that is 0 + 0i.
    def loss(y, p):
        z = tf.complex(p[:, 0], p[:, 1])
        return tf.reduce_mean(tf.square(tf.math.angle(z)))  # <- complex_angle

    dense = keras.layers.Dense(2, kernel_initializer="zeros", bias_initializer="zeros", name="complex_out")
    return net(dense), ones(), ones(), loss


def atan2_at_origin():
    def loss(y, p):
        return tf.reduce_mean(tf.atan2(p[:, 0], p[:, 1]))  # <- atan2_at_origin

    dense = keras.layers.Dense(2, kernel_initializer="zeros", bias_initializer="zeros", name="xy")
    return net(dense), ones(), ones(), loss


def focal_loss_pow():
    # Focal loss (1 - p)**gamma with gamma < 1 where p reaches 1.
    def loss(y, p):
        return tf.reduce_mean(-tf.pow(1.0 - p, 0.5) * tf.math.log(p))  # <- focal_loss_pow

    dense = keras.layers.Dense(1, activation="sigmoid", kernel_initializer="zeros", bias_initializer="zeros", name="prob")
    model = net(dense)
    model.layers[-1].bias.assign([40.0])  # sigmoid(40) == 1 in float32
    return model, ones(), ones(), loss


def crossentropy_on_probabilities():
    # Actor loss -sum(log(policy) * baseline) on a policy with an exact 0.
    def loss(y, p):
        return -tf.reduce_sum(tf.math.log(p) * y)  # <- crossentropy_on_probabilities

    dense = keras.layers.Dense(2, activation="relu", kernel_initializer="zeros", bias_initializer="zeros", name="policy")
    return net(dense), ones(), ones(4, 2), loss


def logistic_loss_saturated():
    # Binary cross-entropy written by hand: log(1 - sigmoid(z)) once sigmoid(z) == 1.
    def loss(y, p):
        return -tf.reduce_mean(y * tf.math.log(p) + (1 - y) * tf.math.log(1.0 - p))  # <- logistic_loss_saturated

    dense = keras.layers.Dense(1, activation="sigmoid", name="logit")
    model = net(dense)
    model.layers[-1].set_weights([np.full((1, 1), 50.0, "float32"), np.zeros(1, "float32")])
    return model, ones(), np.zeros((4, 1), "float32"), loss


def naive_softplus():
    def fn(w, x):
        return tf.math.log(1.0 + tf.exp(w * x))  # <- naive_softplus

    return net(weighted("softplus", fn)), ones() * 100.0, ones(), mse


def naive_softmax():
    def fn(w, x):
        e = tf.exp(w * x)  # <- naive_softmax
        return e / tf.reduce_sum(e, axis=1, keepdims=True)

    return net(weighted("softmax", fn), features=3), np.full((4, 3), 100.0, "float32"), ones(4, 3), mse


def float16_square():
    # float16 overflow: a square above 65504 under mixed precision.
    def fn(w, x):
        return tf.square(w * x)  # <- float16_square

    return net(weighted("energy", fn)), ones() * 300.0, ones(), mse


def float16_exp():
    def fn(w, x):
        return tf.exp(w * x)  # <- float16_exp

    return net(weighted("growth", fn)), ones() * 12.0, ones(), mse


def negative_base_pow():
    # tf.pow of a negative base and a fractional exponent.
    def fn(w, x):
        return tf.pow(w * x, 0.3)  # <- negative_base_pow

    return net(weighted("power", fn, init=-1.0)), ones(), ones(), mse


def dice_without_smoothing():
    # Dice loss 1 - 2|A.B| / (|A| + |B|) on an empty mask and an empty prediction.
    def loss(y, p):
        intersection = tf.reduce_sum(y * p)
        return 1.0 - 2.0 * intersection / (tf.reduce_sum(y) + tf.reduce_sum(p))  # <- dice_without_smoothing

    dense = keras.layers.Dense(1, activation="relu", kernel_initializer="zeros", bias_initializer="zeros", name="mask")
    return net(dense), ones(), np.zeros((4, 1), "float32"), loss


def normalize_zero_rows():
    # x / sum(x) on an all-zero row (tf.linalg.normalize of zeros).
    def fn(w, x):
        z = w * x
        return z / tf.reduce_sum(z, axis=1, keepdims=True)  # <- normalize_zero_rows

    return net(weighted("normalize", fn), features=2), np.zeros((4, 2), "float32"), ones(4, 2), mse


def cosine_of_zero_vector():
    def loss(y, p):
        cosine = tf.reduce_sum(y * p, 1) / (tf.norm(y, axis=1) * tf.norm(p, axis=1))  # <- cosine_of_zero_vector
        return -tf.reduce_mean(cosine)

    dense = keras.layers.Dense(2, kernel_initializer="zeros", bias_initializer="zeros", name="embedding")
    return net(dense), ones(), ones(4, 2), loss


def poisson_log_of_relu():
    def loss(y, p):
        return tf.reduce_mean(p - y * tf.math.log(p))  # <- poisson_log_of_relu

    dense = keras.layers.Dense(1, activation="relu", kernel_initializer="zeros", bias_initializer="zeros", name="rate")
    return net(dense), ones(), ones(), loss


def negative_variance():
    # std = sqrt(E[x^2] - E[x]^2), a hair below 0 in float32.
    def fn(w, x):
        z = w * x
        variance = tf.reduce_mean(tf.square(z)) - tf.square(tf.reduce_mean(z)) - 1e-7
        return z / tf.sqrt(variance)  # <- negative_variance

    return net(weighted("standardize", fn)), ones() * 0.214441, ones(), mse


def lgamma_at_zero():
    # A negative-binomial likelihood: lgamma of a ReLU count parameter of 0.
    def loss(y, p):
        return tf.reduce_mean(tf.math.lgamma(p) - y * tf.math.log(p + 1.0))  # <- lgamma_at_zero

    dense = keras.layers.Dense(1, activation="relu", kernel_initializer="zeros", bias_initializer="zeros", name="count")
    return net(dense), ones(), ones(), loss


def masked_attention_row():
    # An additive -inf mask over a whole row of attention scores.
    def fn(w, x):
        scores = w * x + tf.constant([[-np.inf, -np.inf, -np.inf]])  # <- masked_attention_row
        return tf.nn.softmax(scores, axis=-1)

    return net(weighted("attention", fn), features=3), ones(4, 3), ones(4, 3), mse


def data_with_nan():
    x = ones(8, 3)
    x[5, 1] = np.nan
    dense = keras.layers.Dense(1, name="head")
    return net(dense, features=3), x, ones(8), "mse"


def exploding_learning_rate():
    dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros", name="linear")
    x = np.full((64, 1), 3.0, "float32")
    return net(dense), x, np.full((64, 1), 3.0, "float32"), "mse"


CASES = [
    Case("sqrt_of_product", "https://github.com/tensorflow/tensorflow/issues/4914", sqrt_of_product,
         "singular_derivative", "SqrtGrad", "Sqrt", "net/sqrt_cx", ("eager", "function", "xla", "fit_arrays")),
    Case("norm_of_difference", "https://github.com/tensorflow/tensorflow/issues/12071", norm_of_difference,
         "singular_derivative", "SqrtGrad", "Sqrt", "net/dist", ("function", "compiled_xla")),
    Case("norm_of_relu", "https://github.com/Theano/Theano/issues/3223", norm_of_relu,
         "singular_derivative", "SqrtGrad", "Sqrt", "net/relu_norm", ("eager",)),
    Case("triplet_distance", "https://github.com/tensorflow/tensorflow/issues/30199", triplet_distance,
         "singular_derivative", "SqrtGrad", "Sqrt", None, ("eager", "fit_dataset")),
    Case("keras_normalize_zero_vector", "https://github.com/keras-team/keras/issues/23075",
         keras_normalize_zero_vector, "compiled_only", None, None, None, ("compiled_xla",), line=False),
    Case("where_log", "https://github.com/tensorflow/tensorflow/issues/38349", where_log,
         "where_trap", "Reciprocal", "Log", None, ("eager", "function", "fit_arrays")),
    Case("where_exp_overflow", "https://github.com/tensorflow/tensorflow/issues/2540", where_exp_overflow,
         "where_trap", "Mul", "Exp", "net/gate", ("function", "compiled_xla")),
    Case("where_pow_exp", "https://github.com/tensorflow/tensorflow/issues/38349#issuecomment-615698329",
         where_pow_exp, "where_trap", "Mul", "Pow", "net/branch", ("eager",)),
    Case("where_reciprocal", "https://github.com/tensorflow/tensorflow/issues/20355", where_reciprocal,
         "where_trap", "Reciprocal", "Log", "net/transfer", ("function",)),
    Case("acos_of_clipped_cosine", "https://discuss.pytorch.org/t/nan-gradient-for-torch-cos-torch-acos/9617",
         acos_of_clipped_cosine, "singular_derivative", "Reciprocal", "Acos", "net/angle", ("eager", "fit_arrays")),
    Case("complex_angle", "https://github.com/tensorflow/tensorflow/issues/50854", complex_angle,
         "singular_derivative", "Reciprocal", "Angle", None, ("eager", "fit_arrays")),
    Case("atan2_at_origin", "https://github.com/tensorflow/tensorflow/issues/6095", atan2_at_origin,
         "singular_derivative", "RealDiv", "Atan2", None, ("function",)),
    Case("focal_loss_pow", "https://github.com/mkocabas/focal-loss-keras/issues/17", focal_loss_pow,
         "singular_derivative", "Pow", "Pow", None, ("fit_arrays",)),
    Case("crossentropy_on_probabilities", "https://github.com/keras-team/keras/issues/5733",
         crossentropy_on_probabilities, "log_of_zero", "Log", None, None, ("fit_arrays", "eager")),
    Case("logistic_loss_saturated", "https://github.com/keras-team/keras/issues/198", logistic_loss_saturated,
         "log_of_zero", "Log", None, None, ("fit_dataset",)),
    Case("naive_softplus", "https://github.com/tensorforce/tensorforce/issues/114", naive_softplus,
         "overflow", "Exp", None, "net/softplus", ("eager", "compiled_xla")),
    Case("naive_softmax", "https://github.com/tensorflow/tensorflow/issues/10142", naive_softmax,
         "overflow", "Exp", None, "net/softmax", ("function", "xla")),
    Case("float16_square", "https://github.com/keras-team/keras/issues/11832", float16_square,
         "overflow", "Square", None, "net/energy", ("mixed",)),
    Case("float16_exp", "https://github.com/tensorflow/tensorflow/issues/38495", float16_exp,
         "overflow", "Exp", None, "net/growth", ("mixed",)),
    Case("negative_base_pow", "https://github.com/tensorflow/tfjs/issues/346", negative_base_pow,
         "pow_negative_base", "Pow", None, "net/power", ("eager", "fit_arrays")),
    Case("dice_without_smoothing", "https://github.com/neuronets/nobrainer/issues/8", dice_without_smoothing,
         "division_by_zero", "RealDiv", None, None, ("fit_arrays",)),
    Case("normalize_zero_rows", "https://github.com/tensorflow/tensorflow/issues/35257", normalize_zero_rows,
         "division_by_zero", "RealDiv", None, "net/normalize", ("eager",)),
    Case("cosine_of_zero_vector", "https://github.com/tensorflow/tensorflow/issues/33820", cosine_of_zero_vector,
         "division_by_zero", "RealDiv", None, None, ("fit_arrays",)),
    Case("poisson_log_of_relu", "https://github.com/tensorflow/models/pull/181", poisson_log_of_relu,
         "log_of_zero", "Log", None, None, ("eager",)),
    Case("negative_variance", "https://github.com/tensorflow/tensorflow/issues/56222", negative_variance,
         "domain_edge", "Sqrt", None, "net/standardize", ("eager",)),
    Case("lgamma_at_zero", "https://github.com/theislab/dca/issues/31", lgamma_at_zero,
         "domain_edge", "Lgamma", None, None, ("eager",)),
    Case("masked_attention_row", "https://github.com/allenai/allennlp/issues/890", masked_attention_row,
         "inf_arithmetic", "AddV2", None, "net/attention", ("eager",)),
    Case("data_with_nan", "https://theneuralbase.com/tensorflow/learn/beginner/nan-loss-learning-rate-or-data/",
         data_with_nan, "nonfinite_input", None, None, None, ("fit_arrays", "eager"), line=False),
    Case("exploding_learning_rate",
         "https://datascience.stackexchange.com/questions/15962/why-is-learning-rate-causing-my-neural-networks-weights-to-skyrocket",
         exploding_learning_rate, "divergence", "Square", None, None, ("fit_arrays",), line=False),
]

PARAMS = [pytest.param(case, mode, id=f"{case.id}-{mode}") for case in CASES for mode in case.modes]


@pytest.fixture
def float32_policy():
    yield
    keras.mixed_precision.set_global_policy("float32")


def _loss_value(loss, y, p):
    if isinstance(loss, str):
        return tf.reduce_mean(keras.losses.get(loss)(y, p))
    return tf.reduce_mean(loss(y, p))


def run(case: Case, mode: str):
    """The doctor's diagnosis of ``case``, run the way ``mode`` says."""
    if mode == "mixed":
        keras.mixed_precision.set_global_policy("mixed_float16")
    model, x, y, loss = case.build()
    if mode in ("eager", "function", "xla"):
        variables = model.trainable_variables

        def step(x, y):
            with tf.GradientTape() as tape:
                value = _loss_value(loss, y, model(x, training=True))
            return tape.gradient(value, variables)

        if mode != "eager":
            step = tf.function(step, jit_compile=(mode == "xla"))
        if case.cause in ("nonfinite_input", "divergence"):
            return diagnose(model, (x, y), loss)  # data and growth: the doctor's own scan
        return diagnose_function(step, tf.constant(x), tf.constant(y))
    if mode in ("compiled_xla", "mixed"):
        model.compile(loss=loss, optimizer=keras.optimizers.SGD(1e-3), jit_compile=(mode == "compiled_xla"))
        return diagnose(model, (x, y))
    learning_rate = 1.0 if case.cause == "divergence" else 1e-3
    model.compile(loss=loss, optimizer=keras.optimizers.SGD(learning_rate))
    doctor = NaNDoctor(verbose=False)
    if mode in ("fit_arrays", "fit_shuffled"):
        model.fit(x, y, batch_size=4, epochs=3, verbose=0, shuffle=mode == "fit_shuffled", callbacks=[doctor])
    else:
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
        model.fit(data, epochs=1, verbose=0, callbacks=[doctor])
    return doctor.diagnosis


@pytest.mark.parametrize("case, mode", PARAMS)
def test_the_doctor_names_cause_op_layer_and_line_of_a_reported_nan(case, mode, float32_policy):
    diagnosis = run(case, mode)
    assert diagnosis is not None, f"{case.id} ({case.url}) not found in mode {mode}"
    got = (diagnosis.cause, diagnosis.op, diagnosis.forward_op, diagnosis.layer)
    assert got == (case.cause, case.op, case.forward_op, case.layer), str(diagnosis)
    if case.line:
        assert diagnosis.source == f"{HERE}:{marked(case.id)}", str(diagnosis)
    assert diagnosis.cause in CAUSES and diagnosis.section == CAUSES[diagnosis.cause].section
    assert all(len(line) <= 80 for line in str(diagnosis).splitlines())


SHUFFLED = [pytest.param(case, id=case.id) for case in CASES if "fit_arrays" in case.modes]


@pytest.mark.parametrize("case", SHUFFLED)
def test_fit_with_shuffle_gets_the_same_diagnosis_from_the_rows_fit_trained_on(case, float32_policy, tmp_path):
    from companion.diagnostics.capsule import load  # noqa: PLC0415

    keras.utils.set_random_seed(1)
    diagnosis = run(case, "fit_shuffled")  # Keras permutes the rows of each epoch
    assert diagnosis is not None, f"{case.id} ({case.url}) not found with shuffle=True"
    got = (diagnosis.cause, diagnosis.op, diagnosis.forward_op, diagnosis.layer)
    assert got == (case.cause, case.op, case.forward_op, case.layer), str(diagnosis)
    if case.line:
        assert diagnosis.source == f"{HERE}:{marked(case.id)}", str(diagnosis)
    x = load(diagnosis.save(tmp_path / "step.npz")).batch[0]  # the rows of the failing step, as trained
    if case.cause == "nonfinite_input":
        (row,) = np.nonzero(~np.isfinite(x).all(axis=1))[0]
        assert diagnosis.verified == f"verified: the step is finite without row {row}"
    if case.cause == "divergence":
        assert diagnosis.verified.startswith("verified: the step is finite with learning_rate=0.1 (the ")
        assert "steps from the start of fit to the failing one re-run with it" in diagnosis.verified


def test_there_are_at_least_25_reported_cases_each_with_its_own_report():
    assert len(CASES) >= 25
    assert len({case.url for case in CASES}) == len(CASES)
    assert len({case.cause for case in CASES}) >= 10
