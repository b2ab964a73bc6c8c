"""NaN written by the update, not by the gradient (issue 42, item 1), rebuilt from public reports.

In each report the loss and the gradients of the failing step are finite and the optimizer's
update writes NaN or Inf: its ``epsilon`` is 0 in ``float16``, so where a second moment (or an
accumulator) is 0 the update divides by 0. Each test trains the reporter's kind of model with
``fit`` and :class:`~companion.diagnostics.NaNDoctor` and asserts what the doctor names — the
variable and the optimizer's update, the line that made the optimizer, the cause — and that the
first printed remedy, applied as printed (its call evaluated and compiled in), makes the same
run finite.
"""

from __future__ import annotations

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

from companion.diagnostics import NaNDoctor, diagnose


def _line(function, marker: str) -> int:
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, text in enumerate(lines) if marker in text)


def _optimizers_jl_167(optimizer=None):
    """FluxML/Optimisers.jl#167: float16 weights, Adam(1e-4) with the default (float64) epsilon."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, dtype="float16", name="dense")])
    optimizer = optimizer or keras.optimizers.Adam(1e-4, epsilon=1e-8)  # report-line
    model.compile(optimizer, "mse")
    x = np.tile(np.array([[0.579, -0.729, 0.5493]], "float32"), (8, 1)) * 1e-2
    return model, x, np.zeros((8, 1), "float32")


def _pykoi_69(optimizer=None):
    """CambioML/pykoi#69: a reward model loaded in float16, Adam with an epsilon below 6e-8."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="relu", dtype="float16", name="hidden"),
        keras.layers.Dense(1, dtype="float16", name="reward"),
    ])
    optimizer = optimizer or keras.optimizers.Adam(learning_rate=1e-3, epsilon=1e-8)  # report-line
    model.compile(optimizer, "mse")
    x = np.random.default_rng(0).normal(size=(32, 6)).astype("float32")
    x[:, 4] = 0.0  # a padded feature: its kernel row's gradient is exactly 0
    return model, x, np.random.default_rng(1).normal(size=(32, 1)).astype("float32")


def _pysyft_740(optimizer=None):
    """OpenMined/PySyft#740: RMSProp's epsilon 1e-8 becomes 0 in a low precision and the update is NaN."""
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, dtype="float16", name="dense")])
    optimizer = optimizer or keras.optimizers.RMSprop(learning_rate=1e-3, epsilon=1e-8)  # report-line
    model.compile(optimizer, "mse")
    x = np.random.default_rng(2).normal(size=(16, 4)).astype("float32")
    x[:, 0] = 0.0  # an input that is always 0: a zero gradient, a zero accumulator
    return model, x, np.random.default_rng(3).normal(size=(16, 2)).astype("float32")


def _optax_1790(optimizer=None):
    """google-deepmind/optax#1790: AdaDelta with eps=1e-8 in float16, a zero gradient gives 0/0 = NaN."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(3, activation="tanh", dtype="float16", name="hidden"),
        keras.layers.Dense(1, dtype="float16", name="out"),
    ])
    optimizer = optimizer or keras.optimizers.Adadelta(learning_rate=1.0, epsilon=1e-8)  # report-line
    model.compile(optimizer, "mse")
    x = np.random.default_rng(4).normal(size=(16, 5)).astype("float32")
    x[:, 2] = 0.0
    return model, x, np.random.default_rng(5).normal(size=(16, 1)).astype("float32")


def _optax_1754(optimizer=None):
    """google-deepmind/optax#1754: float16 parameters, Adam's eps=1e-8, an unused embedding row (a zero gradient)."""
    keras.utils.set_random_seed(4)
    model = keras.Sequential([
        keras.Input((5,), dtype="int32"),
        keras.layers.Embedding(10, 4, dtype="float16", name="tokens"),
        keras.layers.GlobalAveragePooling1D(dtype="float16"),
        keras.layers.Dense(1, dtype="float16", name="head"),
    ])
    optimizer = optimizer or keras.optimizers.Adam(learning_rate=1e-3, epsilon=1e-8)  # report-line
    model.compile(optimizer, "mse")
    x = np.random.default_rng(6).integers(0, 7, size=(16, 5)).astype("int32")  # rows 7, 8, 9 never used
    return model, x, np.random.default_rng(7).normal(size=(16, 1)).astype("float32")


class Denoiser(keras.Model):
    """afiaka87/glide-finetune#5: a diffusion model fine-tuned in half precision by its own step."""

    def __init__(self):
        super().__init__()
        self.steps = keras.layers.Embedding(8, 4, dtype="float16", name="timestep")
        self.net = keras.layers.Dense(4, dtype="float16", name="net")

    def call(self, inputs):
        noisy, t = inputs
        return self.net(noisy + tf.cast(self.steps(t), noisy.dtype))

    def train_step(self, images):
        t = tf.random.stateless_uniform((tf.shape(images)[0],), seed=[1, 2], maxval=4, dtype=tf.int32)
        noise = tf.random.stateless_normal(tf.shape(images), seed=[3, 4], dtype=images.dtype)
        with tf.GradientTape() as tape:
            predicted = self((tf.cast(images + noise, "float16"), t), training=True)
            loss = tf.reduce_mean(tf.square(tf.cast(predicted, "float32") - noise))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def _glide_finetune_5(optimizer=None):
    keras.utils.set_random_seed(5)
    model = Denoiser()
    optimizer = optimizer or keras.optimizers.Adam(learning_rate=1e-4, epsilon=1e-8)  # report-line
    model.compile(optimizer=optimizer)
    return model, np.random.default_rng(8).normal(size=(16, 4)).astype("float32"), None


REPORTS = {
    "FluxML/Optimisers.jl#167": (_optimizers_jl_167, "dense/kernel", "Adam"),
    "CambioML/pykoi#69": (_pykoi_69, "hidden/kernel", "Adam"),
    "OpenMined/PySyft#740": (_pysyft_740, "dense/kernel", "RMSprop"),
    "google-deepmind/optax#1790": (_optax_1790, "hidden/kernel", "Adadelta"),
    "google-deepmind/optax#1754": (_optax_1754, "tokens/embeddings", "Adam"),
    "afiaka87/glide-finetune#5": (_glide_finetune_5, "timestep/embeddings", "Adam"),  # its own train_step
}


def _fit(model, x, y, callbacks=()):
    return model.fit(x, y, batch_size=len(x), epochs=3, shuffle=False, verbose=0, callbacks=list(callbacks))



def _all_finite(model) -> bool:
    values = [v.numpy() for v in model.variables] + [v.numpy() for v in model.optimizer.variables]
    return all(np.all(np.isfinite(np.asarray(v, np.float64))) for v in values if np.asarray(v).dtype.kind == "f")


@pytest.mark.parametrize("report", sorted(REPORTS))
def test_the_doctor_names_the_update_the_line_the_cause_and_a_remedy_that_cures(report, capsys):
    build, variable, optimizer_name = REPORTS[report]
    model, x, y = build()
    _fit(model, x, y)
    assert not _all_finite(model), f"{report}: the rebuild must fail as reported"
    model, x, y = build()
    doctor = NaNDoctor()
    _fit(model, x, y, [doctor])
    d = doctor.diagnosis
    assert d is not None, capsys.readouterr().out
    assert d.cause == "nonfinite_update" and d.phase == "update"
    assert d.op == f"{optimizer_name}.apply"
    assert d.variables and d.variables[0].endswith(variable), d.variables
    assert d.dtype == "float16"
    assert "epsilon=1e-08 is 0 in float16" in d.inputs_summary, d.inputs_summary
    assert d.source.endswith(f"test_doctor_update_nan.py:{_line(build, 'report-line')}"), d.source
    assert d.verified.startswith("verified:"), d.verified
    printed = capsys.readouterr().out
    assert printed.index("remedy:") < printed.index("fix:")  # the remedy is printed first
    # The first printed remedy, applied as printed: its call is the optimizer of the same run.
    call = d.remedy.partition(" (the optimizer made at")[0]
    assert call.startswith(f"keras.optimizers.{optimizer_name}(") and "epsilon=0.0001" in call, d.remedy
    model, x, y = build(eval(call, {"keras": keras}))  # noqa: S307 - the doctor's own printed call
    history = _fit(model, x, y)
    assert _all_finite(model) and np.all(np.isfinite(history.history["loss"]))


def test_diagnose_alone_finds_the_update_of_a_fresh_model():
    model, x, y = _pykoi_69()
    before = [v.numpy().copy() for v in model.variables]
    d = diagnose(model, (x, y))
    assert d is not None and d.cause == "nonfinite_update" and d.variables[0].endswith("hidden/kernel")
    assert "_velocity" in d.inputs_summary and "exactly 0" in d.inputs_summary, d.inputs_summary  # v = 0
    after = [v.numpy() for v in model.variables]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))  # computed on copies
    assert not model.optimizer.built or int(model.optimizer.iterations.numpy()) == 0


def test_a_float32_model_with_the_same_optimizer_is_not_diagnosed():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(epsilon=1e-8), "mse")
    x = np.random.default_rng(0).normal(size=(32, 6)).astype("float32")
    x[:, 4] = 0.0
    assert diagnose(model, (x, np.zeros((32, 1), "float32"))) is None


def _keras_9582(bn_dtype="float16"):
    """keras-team/keras#9582: BatchNormalization with the float type set to float16; NaN after the first batch."""
    keras.utils.set_random_seed(6)
    model = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(8, dtype="float16", name="conv"),
        keras.layers.BatchNormalization(dtype=bn_dtype, name="bn"),  # report-line
        keras.layers.Dense(1, activation="sigmoid", dtype="float16", name="out"),
    ])
    model.compile(keras.optimizers.SGD(1e-3), "binary_crossentropy")
    x = (np.random.default_rng(9).normal(size=(32, 4)) * 4000).astype("float32")  # raw pixel-scale features
    return model, x, (np.random.default_rng(10).random((32, 1)) > 0.5).astype("float32")


def test_a_moving_variance_that_overflows_float16_is_named_with_its_layer_and_a_float32_remedy(capsys):
    model, x, y = _keras_9582()
    _fit(model, x, y)
    assert not _all_finite(model), "the rebuild must fail as reported"
    model, x, y = _keras_9582()
    doctor = NaNDoctor()
    _fit(model, x, y, [doctor])
    d = doctor.diagnosis
    assert d is not None, capsys.readouterr().out
    assert d.cause == "nonfinite_update" and d.phase == "update" and d.layer.endswith("/bn")
    assert d.variables[0].endswith("bn/moving_variance") and d.dtype == "float16"
    assert "beyond float16's largest 65504" in d.inputs_summary, d.inputs_summary
    assert d.source.endswith(f"test_doctor_update_nan.py:{_line(_keras_9582, 'report-line')}"), d.source
    assert 'BatchNormalization(..., dtype="float32") for layer \'bn\'' in d.remedy, d.remedy
    assert d.verified.startswith("verified:"), d.verified
    model, x, y = _keras_9582(bn_dtype="float32")  # the remedy, as printed: that layer in float32
    history = _fit(model, x, y)
    assert _all_finite(model) and np.all(np.isfinite(history.history["loss"]))


def _optimi_15(head_dtype="float16"):
    """warner-benjamin/optimi#15: Adam's state in float16, a gradient near 1000 whose square passes 65504."""
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, dtype=head_dtype, name="scale")])  # report-line
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    x = np.random.default_rng(11).normal(size=(32, 4)).astype("float32")
    return model, x, np.full((32, 1), 1000.0, "float32")


def test_a_second_moment_that_overflows_float16_is_named_with_a_verified_mixed_precision_remedy(capsys):
    model, x, y = _optimi_15()
    _fit(model, x, y)
    assert not _all_finite(model), "the rebuild must fail as reported"
    model, x, y = _optimi_15()
    doctor = NaNDoctor()
    _fit(model, x, y, [doctor])
    d = doctor.diagnosis
    assert d is not None, capsys.readouterr().out
    assert d.cause == "nonfinite_update" and d.op == "Adam.apply" and d.layer.endswith("/scale")
    assert d.variables[0].endswith("scale_kernel_velocity"), d.variables  # the optimizer's state, not the weight
    assert "the gradient's square, up to" in d.inputs_summary and "beyond float16's largest 65504" in d.inputs_summary
    assert d.remedy.startswith(f"at test_doctor_update_nan.py:{_line(_optimi_15, 'report-line')}: "), d.remedy
    assert 'Dense(..., dtype="mixed_float16") for layer \'scale\'' in d.remedy and d.verified.startswith("verified:")
    model, x, y = _optimi_15(head_dtype="mixed_float16")  # the remedy, as printed
    history = _fit(model, x, y)
    assert _all_finite(model) and np.all(np.isfinite(history.history["loss"]))


def test_train_skips_the_step_and_its_report_names_the_update():
    from companion.training import train

    model, x, y = _pykoi_69()
    history = train(model, x, y, batch_size=len(x), epochs=2, shuffle=False, verbose=0)
    assert history.skipped == [0, 1] and _all_finite(model)  # no step applied its non-finite update
    d = history.reports[0].diagnosis
    assert d is not None and d.cause == "nonfinite_update" and d.variables[0].endswith("hidden/kernel")
    assert d.verified.startswith("verified:") and "epsilon=0.0001" in d.remedy


def test_the_failing_step_of_an_update_nan_is_saved_and_replays_non_finite(tmp_path):
    from companion.diagnostics import replay

    model, x, y = _optimizers_jl_167()
    d = diagnose(model, (x, y))
    assert d is not None and d.cause == "nonfinite_update"
    path = d.save(tmp_path / "update.npz")
    model, _, _ = _optimizers_jl_167()  # the model rebuilt, as a user replays the capsule
    again = replay(path, model, verbose=False)
    assert not again.finite and again.diagnosis.cause == "nonfinite_update"
    assert again.diagnosis.variables[0].endswith("dense/kernel") and again.restored > 0


def _gain(dtype="float16"):
    keras.utils.set_random_seed(8)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, dtype=dtype, name="gain")])
    model.compile(keras.optimizers.SGD(learning_rate=100.0), "mse")
    return model, np.full((8, 2), 10.0, "float32"), np.full((8, 1), 100.0, "float32")


def test_a_weight_the_update_carries_beyond_float16s_range_is_named_with_its_float64_value():
    model, x, y = _gain()
    d = diagnose(model, (x, y))
    assert d is not None and d.cause == "nonfinite_update" and d.op == "SGD.apply"
    assert d.variables[0].endswith("gain/kernel")
    assert "in float64 the update is finite, up to" in d.inputs_summary
    assert "beyond float16's largest 65504" in d.inputs_summary
    assert 'Dense(..., dtype="mixed_float16") for layer \'gain\'' in d.remedy and d.verified.startswith("verified:")
    model, x, y = _gain("mixed_float16")  # the remedy, as printed: the failing step is finite with it
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert _all_finite(model)


def test_the_line_that_made_the_optimizer_is_found_in_an_earlier_notebook_cell():
    """In Jupyter or Colab a cell's code is no file on disk: ipykernel names it like
    /tmp/ipykernel_<pid>/<hash>.py and keeps its source in linecache. The optimizer made in
    one cell and diagnosed from another is named at that cell's line."""
    import linecache

    from companion.book.mechanisms import half_precision_regression
    from companion.diagnostics import diagnose

    cell = "/tmp/ipykernel_4242/2718281828.py"
    source = "import keras\n\noptimizer = keras.optimizers.Adam(2e-3, epsilon=1e-8)\n"
    linecache.cache[cell] = (len(source), None, source.splitlines(True), cell)
    try:
        namespace: dict = {}
        exec(compile(source, cell, "exec"), namespace)
        model, x, y = half_precision_regression(optimizer=namespace["optimizer"])
        d = diagnose(model, (x, y))
    finally:
        del linecache.cache[cell]
    assert d is not None and d.cause == "nonfinite_update"
    assert d.source == f"{cell}:3" and "epsilon=1e-8" in d.code, (d.source, d.code)


class WithAnUnusedLayer(keras.Model):
    """pykoi#69's model, subclassed, with a layer its call does not use: a trainable weight
    with no gradient, on which ``compile``'s optimizer is built too."""

    def __init__(self):
        super().__init__()
        keras.utils.set_random_seed(1)
        self.hidden = keras.layers.Dense(8, activation="relu", dtype="float16", name="hidden")
        self.reward = keras.layers.Dense(1, dtype="float16", name="reward")
        self.unused = keras.layers.Dense(2, name="unused")
        self.unused.build((None, 6))

    def call(self, x):
        return self.reward(self.hidden(x))


def test_an_update_is_diagnosed_when_a_weight_has_no_gradient():
    _, x, y = _pykoi_69()
    model = WithAnUnusedLayer()
    model.compile(keras.optimizers.Adam(learning_rate=1e-3, epsilon=1e-8), "mse")
    model(x[:1])
    model.optimizer.build(model.trainable_variables)  # as fit builds it: on every weight
    d = diagnose(model, (x, y))
    assert d is not None and d.cause == "nonfinite_update" and d.variables[0].endswith("hidden/kernel")
