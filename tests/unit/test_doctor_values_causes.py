"""Causes read from what the values did, on rebuilt public reports (issue 42, item 7).

Three kinds of failure whose op says little: a sparse cross-entropy given a label outside
its classes (an eager CPU kernel raises, XLA returns NaN, so the op-by-op re-run never sees
a non-finite output), a learning rate that a schedule drives below 0 or up and up (every
step climbs the loss: a rate ten times smaller cures nothing), and targets that a loop
computes from the model's own outputs (Q-learning) and that grow with them. The doctor
names each from the values: the labels at the op against the logits' classes, the rate
and the schedule's rates at the failing step, the targets against the model's outputs.

Each test rebuilds a public report (cited) the way its reporter trained, and asserts the
op, the line, the cause, and that the first printed remedy, applied as printed, makes
the failing run finite. A line is the one marked ``# <- id`` in this file; ``None``
where no line of the user's makes the op (a loss compiled from Keras' own).
"""

from __future__ import annotations

import numpy as np
import keras
import pytest
import tensorflow as tf

from companion.diagnostics import CAUSES, NaNDoctor, diagnose, diagnose_function

HERE = __file__


def marked(case: str) -> str:
    """``file:line`` of the line of this file that ends with ``# <- case``."""
    lines = open(HERE).read().splitlines()
    (number,) = [i for i, line in enumerate(lines, start=1) if line.rstrip().endswith(f"# <- {case}")]
    return f"{HERE}:{number}"


def checked(d) -> None:
    """The remedy printed first is verified, and the report says what was run."""
    assert d.remedy and str(d).split("\n  remedy:", 1)[1].split()[0] == d.remedy.split()[0], str(d)
    assert d.verified is not None and d.verified.startswith("verified: "), str(d)
    assert "  checked:   verified:" in str(d)
    assert d.section == CAUSES[d.cause].section


def fit_is_finite(model, x, y, **kwargs) -> bool:
    history = model.fit(x, y, verbose=0, shuffle=False, **kwargs)
    logged = [v for values in history.history.values() for v in values]
    return bool(np.all(np.isfinite(logged))) and all(np.isfinite(w).all() for w in model.get_weights())


# --------------------------------------------------------------------------------------
# Labels outside [0, classes): eager raises, XLA returns NaN
# --------------------------------------------------------------------------------------


def test_xla_step_with_a_label_outside_the_classes_is_label_out_of_range_and_its_masking_cures():
    """tensorflow/tensorflow#126005 (https://github.com/tensorflow/tensorflow/issues/126005).

    ``tf.nn.sparse_softmax_cross_entropy_with_logits`` with labels ``[1, 2, 0]`` and two
    classes: eager raises, ``tf.function(jit_compile=True)`` silently returns NaN. The
    doctor left it unclassified (the op-by-op re-run raised and traced nothing).
    """
    keras.utils.set_random_seed(0)
    head = keras.layers.Dense(2, name="head")
    head.build((None, 3))

    def step(fixed):
        @tf.function(jit_compile=True)
        def gradients(x, labels):
            with tf.GradientTape() as tape:
                logits = head(x)
                if fixed:  # the remedy, as printed
                    valid = ((labels >= 0) & (labels < 2))
                    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
                        tf.where(valid, labels, 0), logits) * tf.cast(valid, tf.float32)
                else:
                    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)  # <- xent
                loss = tf.reduce_mean(losses)
            return loss, tape.gradient(loss, head.trainable_variables)

        return gradients

    x, labels = tf.ones((3, 3)), tf.constant([1, 2, 0])
    assert not np.isfinite(step(False)(x, labels)[0].numpy())
    d = diagnose_function(step(False), x, labels)
    assert (d.op, d.cause, d.source) == ("SparseSoftmaxCrossEntropyWithLogits", "label_out_of_range",
                                         marked("xent")), str(d)
    assert "1 of 3 labels of SparseSoftmaxCrossEntropyWithLogits are outside [0, 2)" in d.inputs_summary
    assert "tf.where(((labels >= 0) & (labels < 2)), labels, 0), ...) * tf.cast(((labels >= 0) & (labels < 2))" \
        in d.remedy, d.remedy
    checked(d)
    loss, grads = step(True)(x, labels)
    assert np.isfinite(loss.numpy()) and all(np.isfinite(g.numpy()).all() for g in grads)


def _classifier(classes, *, softmax=False, loss=None, features=4):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(8, activation="relu", name="hidden"),
                              keras.layers.Dense(classes, activation="softmax" if softmax else None, name="out")],
                             name="classifier")
    model.compile(optimizer="adam", jit_compile=True,
                  loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=not softmax))
    return model


def test_fit_under_xla_with_one_label_too_many_is_label_out_of_range_and_weighting_it_out_cures():
    """tensorflow/tensorflow#8484 (https://github.com/tensorflow/tensorflow/issues/8484).

    ``ys = np.random.randint(classes + 1, size=n)`` for five classes: the CPU kernel
    raises, the GPU's (here XLA's) returns a NaN loss and "then everything in the model
    becomes NaN". ``fit`` with ``jit_compile=True`` and the doctor attached.
    """
    rng = np.random.default_rng(0)
    x = rng.random((64, 4)).astype("float32")
    y = rng.integers(5 + 1, size=64)
    model = _classifier(5)
    doctor = NaNDoctor(verbose=False)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[doctor])
    d = doctor.diagnosis
    assert d is not None
    assert (d.op, d.cause, d.source) == ("SparseSoftmaxCrossEntropyWithLogits", "label_out_of_range", None), str(d)
    assert "outside [0, 5) of the logits' 5 classes (5)" in d.inputs_summary
    assert d.remedy.startswith("labels to ignore get a sample weight of 0 (and label 0): w = tf.cast((y >= 0) & "
                               "(y < 5), tf.float32); y = tf.where(w > 0, y, 0)"), d.remedy
    checked(d)
    w = tf.cast((y >= 0) & (y < 5), tf.float32)  # as printed
    fixed_y = tf.where(w > 0, y, 0)
    assert fit_is_finite(_classifier(5), x, fixed_y.numpy(), sample_weight=w.numpy(), batch_size=16, epochs=2)


def yolo_class_loss(y_true, y_pred):
    """The class part of a YOLO loss: sparse cross-entropy of the class ids."""
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)  # <- yolo


def test_class_ids_that_start_at_1_are_label_out_of_range_and_shifting_them_cures():
    """yyccR/yolov5_in_tf2_keras#5 (https://github.com/yyccR/yolov5_in_tf2_keras/issues/5).

    ``sparse_categorical_crossentropy`` gives NaN on some data though no input is NaN:
    "when the class id is larger than num_classes"; with ids that start at 1 the classes
    are off by one. Rebuilt with ids 1..10 for ten classes, compiled with XLA as on a GPU.
    """
    rng = np.random.default_rng(1)
    x = rng.random((48, 4)).astype("float32")
    ids = rng.integers(1, 11, size=48)
    d = diagnose(_classifier(10, loss=yolo_class_loss), (x, ids), batch_size=16)
    assert (d.op, d.cause, d.source) == ("SparseSoftmaxCrossEntropyWithLogits", "label_out_of_range",
                                         marked("yolo")), str(d)
    assert d.layer is None
    assert d.remedy.startswith("labels from 0: y - 1 in the input pipeline (the labels run from 1 to 10"), d.remedy
    checked(d)
    assert fit_is_finite(_classifier(10, loss=yolo_class_loss), x, ids - 1, batch_size=16, epochs=2)


def test_signed_class_labels_are_label_out_of_range_and_shifting_them_to_0_cures():
    """tplusone/hanser_ml_zeitreihen#3 (https://github.com/tplusone/hanser_ml_zeitreihen/issues/3).

    Classes on a scale from -6 to +6 with ``sparse_categorical_crossentropy``: "NaN"
    predictions, because the classes must start at 0. Thirteen softmax outputs, the
    string loss, XLA.
    """
    rng = np.random.default_rng(2)
    x = rng.random((52, 4)).astype("float32")
    scale = rng.integers(-6, 7, size=52)
    model = _classifier(13, softmax=True, loss="sparse_categorical_crossentropy")
    d = diagnose(model, (x, scale), batch_size=13)
    assert (d.op, d.cause, d.source) == ("SparseSoftmaxCrossEntropyWithLogits", "label_out_of_range", None), str(d)
    assert d.remedy.startswith("labels from 0: y + 6 in the input pipeline (the labels run from -6 to 6;"), d.remedy
    checked(d)
    model = _classifier(13, softmax=True, loss="sparse_categorical_crossentropy")
    assert fit_is_finite(model, x, scale + 6, batch_size=13, epochs=2)


class RetrievalLoss(keras.losses.Loss):
    """A two-tower retrieval loss: the item's index among the candidates' logits."""

    def call(self, y_true, y_pred):
        labels = tf.cast(tf.reshape(y_true, [-1]), tf.int32)
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=y_pred)  # <- retrieval


def test_an_item_index_equal_to_the_number_of_items_is_label_out_of_range_and_weighting_it_out_cures():
    """biarne-a/hm-two-step-reco#3 (https://github.com/biarne-a/hm-two-step-reco/issues/3).

    "Received a label value of 66908 which is outside the valid range of [0, 66908)":
    an item index one past the candidates, in a custom loss calling
    ``tf.nn.sparse_softmax_cross_entropy_with_logits``. Eagerly it raises; compiled with
    XLA (as on a GPU) the loss is NaN.
    """
    rng = np.random.default_rng(3)
    x = rng.random((32, 4)).astype("float32")
    items = rng.integers(0, 6, size=(32, 1))
    items[5] = 6  # the index one past the last item
    d = diagnose(_classifier(6, loss=RetrievalLoss()), (x, items), batch_size=16)
    assert (d.op, d.cause, d.source) == ("SparseSoftmaxCrossEntropyWithLogits", "label_out_of_range",
                                         marked("retrieval")), str(d)
    assert "1 of 16 labels" in d.inputs_summary and "outside [0, 6)" in d.inputs_summary
    assert d.remedy.startswith("labels to ignore get a sample weight of 0"), d.remedy
    checked(d)
    w = tf.cast((items >= 0) & (items < 6), tf.float32)  # as printed
    fixed = tf.where(w > 0, items, 0)
    assert fit_is_finite(_classifier(6, loss=RetrievalLoss()), x, fixed.numpy(), sample_weight=w.numpy()[:, 0],
                         batch_size=16, epochs=2)


# --------------------------------------------------------------------------------------
# A learning rate that a schedule drives below 0, or up and up
# --------------------------------------------------------------------------------------


def _regression(schedule):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="relu", name="hidden"),
                              keras.layers.Dense(1, name="out")], name="regression")
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype("float32")
    return model, x, x.sum(axis=1, keepdims=True)


class DecayingRate(keras.optimizers.schedules.LearningRateSchedule):
    """A rate that falls by the same amount each step (a distilled, learned rate's path)."""

    def __init__(self, rate, steps, fixed=False):
        self.rate, self.steps, self.fixed = rate, steps, fixed

    def __call__(self, step):
        if self.fixed:  # the remedy, as printed
            return tf.clip_by_value(self.rate * (1.0 - tf.cast(step, tf.float32) / self.steps), 0.00125, 0.05)
        return self.rate * (1.0 - tf.cast(step, tf.float32) / self.steps)  # <- decay


def _run_with_doctor(model, x, y, epochs):
    doctor = NaNDoctor(verbose=False)
    model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, shuffle=False, callbacks=[doctor])
    return doctor.diagnosis


def test_a_rate_that_falls_below_0_is_a_learning_rate_cause_and_clipping_the_schedule_cures():
    """GeorgeCazenavette/mtt-distillation#16 (https://github.com/GeorgeCazenavette/mtt-distillation/issues/16).

    "very large loss ... and negative learning rate": a rate that keeps falling goes
    below 0, every step then climbs the loss, and the run overflows. A rate ten times
    smaller (what the doctor printed for a divergence) is still negative.
    """
    model, x, y = _regression(DecayingRate(0.05, 40))
    d = _run_with_doctor(model, x, y, epochs=40)
    assert d is not None and d.cause == "learning_rate", str(d)
    assert d.op == "Square" and d.phase == "loss"
    assert "the learning rate at the failing step (step 92) is -0.065; it fell to 0 or below at step 40" \
        in d.inputs_summary, d.inputs_summary
    assert d.remedy == (f"at test_doctor_values_causes.py:{marked('decay').rpartition(':')[2]}: return self.rate * "
                        "(1.0 - tf.cast(step, tf.float32) / self.steps) -> return tf.clip_by_value(self.rate * (1.0 - "
                        "tf.cast(step, tf.float32) / self.steps), 0.00125, 0.05) (the rate of DecayingRate kept in "
                        "[0.00125, 0.05], the rates it gave before; at the failing step it is -0.065)"), d.remedy
    assert "ten times smaller" not in str(d)
    checked(d)
    assert "the 93 steps from the start of fit to the failing one re-run with it" in d.verified
    model, x, y = _regression(DecayingRate(0.05, 40, fixed=True))
    assert fit_is_finite(model, x, y, batch_size=16, epochs=40)


def test_an_exponential_schedule_that_grows_is_a_learning_rate_cause_and_its_argument_fixed_cures():
    """tensorflow/tensor2tensor#614 (https://github.com/tensorflow/tensor2tensor/issues/614).

    "NaN loss occurred with exp ... learning_rate_decay_scheme": an exponential scheme
    whose factor per decay period is above 1 makes the rate grow without end, and the
    loss turns NaN. Rebuilt with Keras' ``ExponentialDecay(0.01, 4, 1.5)``.
    """
    model, x, y = _regression(keras.optimizers.schedules.ExponentialDecay(0.01, 4, 1.5))
    d = _run_with_doctor(model, x, y, epochs=20)
    assert d is not None and d.cause == "learning_rate", str(d)
    assert d.op == "Square"
    assert "times the median of the steps before it" in d.inputs_summary and "still growing" in d.inputs_summary
    assert d.remedy.startswith("fix the schedule's arguments: keras.optimizers.schedules.ExponentialDecay(..., "
                               "decay_rate=1.5 -> decay_rate=0.6667)"), d.remedy
    checked(d)
    model, x, y = _regression(keras.optimizers.schedules.ExponentialDecay(0.01, 4, 0.6667))  # as printed
    assert fit_is_finite(model, x, y, batch_size=16, epochs=20)


class Warmup(keras.optimizers.schedules.LearningRateSchedule):
    """A linear warmup towards the peak rate, over ``warmup`` steps."""

    def __init__(self, peak, warmup, cap=None):
        self.peak, self.warmup, self.cap = peak, warmup, cap

    def __call__(self, step):
        if self.cap is not None:  # the remedy, as printed
            return tf.clip_by_value(tf.cast(step, tf.float32) / self.warmup * self.peak, self.cap[0], self.cap[1])
        return tf.cast(step, tf.float32) / self.warmup * self.peak  # <- warmup


def test_a_warmup_that_never_ends_is_a_learning_rate_cause_and_capping_it_cures():
    """YunYang1994/TensorFlow2.0-Examples#8 (https://github.com/YunYang1994/TensorFlow2.0-Examples/issues/8).

    "lr: 0.000598 ... total_loss: nan": the warmup steps were counted from a large data
    set, so the run never left the warmup and the rate rose step after step until the
    loss turned NaN ("the learning rate keeps rising").
    """
    model, x, y = _regression(Warmup(2.0, 200))
    d = _run_with_doctor(model, x, y, epochs=30)
    assert d is not None and d.cause == "learning_rate", str(d)
    assert "the learning rate rose step after step to" in d.inputs_summary, d.inputs_summary
    line = marked("warmup").rpartition(":")[2]
    assert d.remedy.startswith(f"at test_doctor_values_causes.py:{line}: return tf.cast(step, tf.float32) / "
                               "self.warmup * self.peak -> return tf.clip_by_value(tf.cast(step, tf.float32) / "
                               "self.warmup * self.peak, "), d.remedy
    checked(d)
    low, high = (float(v) for v in d.remedy.split("self.peak, ")[1].split(")")[0].split(", "))
    model, x, y = _regression(Warmup(2.0, 200, cap=(low, high)))  # as printed
    assert fit_is_finite(model, x, y, batch_size=16, epochs=30)


# --------------------------------------------------------------------------------------
# Targets made from the model's own outputs (Q-learning)
# --------------------------------------------------------------------------------------


def _q_learning(clipnorm=None, steps=400):
    """A Q-learning loop on a linear Q-function whose next states look larger than its states.

    Returns the model and, at the first step whose loss is not finite, its batch and the
    weights before it (the loop stops there), else ``None``.
    """
    keras.utils.set_random_seed(0)
    q = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, use_bias=False, name="q")], name="dqn")
    q.compile(optimizer=keras.optimizers.SGD(0.2, **({"clipnorm": clipnorm} if clipnorm else {})), loss="mse")
    rng = np.random.default_rng(0)
    for _ in range(steps):
        states = rng.uniform(0.5, 1.0, size=(8, 4)).astype("float32")
        after = 1.5 * states
        actions, rewards = rng.integers(2, size=8), rng.normal(size=8).astype("float32") * 0.1
        targets = q(states).numpy()
        targets[np.arange(8), actions] = rewards + 0.99 * q(after).numpy().max(axis=1)  # <- bootstrap
        before = q.get_weights()
        loss = q.train_on_batch(states, targets)
        if not np.isfinite(loss):
            q.set_weights(before)
            return q, (states, targets)
    return q, None


@pytest.mark.skipif(
    tuple(int(p) for p in keras.__version__.split(".")[:2]) < (3, 15),
    reason="before Keras 3.15 (the Colab stack's 3.13, the oldest stack's 3.5) the rebuilt run's failing step is "
           "non-finite in train_on_batch but finite when the doctor re-runs it (a loss of 9e36): not diagnosed there "
           "(a known gap)",
)
def test_q_learning_targets_that_grow_with_the_q_values_are_bootstrapped_targets_and_clipnorm_cures():
    """farizrahman4u/qlearning4k#13 (https://github.com/farizrahman4u/qlearning4k/issues/13).

    A Q-learning agent's loss turns NaN "about halfway through the first epoch": the
    targets, the model's own predictions with the reward added, turn NaN with them
    (a loss of 6e21 the step before). The doctor, given the failing batch, called it an
    overflow of the loss's square and printed no remedy.
    """
    q, failing = _q_learning()
    assert failing is not None, "the rebuilt run did not fail"
    d = diagnose(q, failing)  # <- dqn
    assert d.cause == "bootstrapped_targets", str(d)
    # the mean squared error overflows (Keras' compiled loss: the line is the call that ran it)
    assert d.op in ("Square", "SquaredDifference", "Sum", "Mean") and d.phase == "loss", str(d)
    assert d.source == marked("dqn")
    assert "50% of the targets equal the outputs" in d.inputs_summary, d.inputs_summary
    assert d.remedy.startswith("recompile with gradient clipping: keras.optimizers.SGD(learning_rate=0.2, "
                               "clipnorm=1.0)"), d.remedy
    # only this step is known, from weights that are already that large: said, not claimed
    assert d.verified.startswith("not verified: the targets are made from the model's own outputs by the loop"), \
        d.verified
    assert "  checked:   not verified:" in str(d)
    _, failing = _q_learning(clipnorm=1.0)  # as printed
    assert failing is None


def _q_step(q):
    def step(states, actions, rewards, after):
        targets = rewards + 0.99 * tf.reduce_max(q(after), axis=1)
        with tf.GradientTape() as tape:
            taken = tf.reduce_sum(q(states) * tf.one_hot(actions, 2), axis=1)
            loss = tf.reduce_mean(tf.square(targets - taken))  # <- td
        return loss, tape.gradient(loss, q.trainable_variables)

    return step


def _custom_q_learning(clip: bool, steps=400):
    """A custom tf.function Q-learning loop; the failing step's arguments, or ``None`` if every step is finite."""
    keras.utils.set_random_seed(0)
    q = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, use_bias=False, name="q")], name="agent")
    optimizer = keras.optimizers.SGD(0.2)
    step, rng = _q_step(q), np.random.default_rng(0)
    compiled = tf.function(step)
    for _ in range(steps):
        states = rng.uniform(0.5, 1.0, size=(8, 4)).astype("float32")
        batch = (states, rng.integers(2, size=8), (rng.normal(size=8) * 0.1).astype("float32"), 1.5 * states)
        loss, gradients = compiled(*batch)
        if not np.isfinite(loss.numpy()):
            return step, batch
        if clip:  # the remedy, as printed
            gradients, _ = tf.clip_by_global_norm(gradients, 1.0)
        optimizer.apply(gradients, q.trainable_variables)
    return None


def test_a_custom_q_learning_loop_that_overflows_is_bootstrapped_targets_and_bounded_steps_cure():
    """keras-rl/keras-rl#28 (https://github.com/keras-rl/keras-rl/issues/28).

    A deep Q-learning agent's loss climbs (6.6e3, 8.7e3, 1.6e7, ...) and its actions
    turn NaN: "the reward is blowing up". Rebuilt as a custom ``tf.function`` loop whose
    targets are ``r + 0.99 * max Q(s')``: after about two hundred steps the squared TD
    error overflows. The doctor called it an overflow and printed no remedy.
    """
    step, batch = _custom_q_learning(clip=False)
    d = diagnose_function(step, *batch)
    assert (d.cause, d.source) == ("bootstrapped_targets", marked("td")), str(d)
    assert d.op in ("Mean", "Square", "Sum"), str(d)
    assert "agent/q ran 2 times in the step" in d.inputs_summary, d.inputs_summary
    assert d.remedy.startswith("bound each step: tf.clip_by_global_norm(gradients, 1.0) before the optimizer "
                               "applies them"), d.remedy
    assert d.verified.startswith("not verified: diagnose_function runs this one call of the step"), d.verified
    assert _custom_q_learning(clip=True) is None  # as printed: every step finite


def test_a_rate_a_callback_sets_below_0_is_a_learning_rate_cause_and_a_positive_floor_cures():
    """A ``LearningRateScheduler`` whose linear decay passes 0 (the kind of the reports above).

    The optimizer holds a rate, not a schedule: the doctor reads its value at the failing
    step and prints a positive rate with where to floor it; a re-run of fit's steps at one
    rate cannot replay the rates the callback set, and the check says so.
    """

    def decay(epoch, rate):
        return 0.05 - 0.01 * epoch  # <- scheduler

    model, x, y = _regression(0.05)
    doctor = NaNDoctor(verbose=False)
    model.fit(x, y, batch_size=16, epochs=40, verbose=0, shuffle=False,
              callbacks=[keras.callbacks.LearningRateScheduler(decay), doctor])
    d = doctor.diagnosis
    assert d is not None and d.cause == "learning_rate", str(d)
    assert d.inputs_summary.startswith("the learning rate at the failing step is -"), d.inputs_summary
    assert d.remedy.startswith("a positive learning rate: keras.optimizers.SGD(learning_rate=0.0"), d.remedy
    assert "return max(rate, " in d.remedy and "ten times smaller" not in str(d)
    # the rates the callback set in earlier epochs are not the optimizer's to replay: said, not claimed
    assert d.verified.startswith("not verified: the 55 steps from the start of fit") and \
        "does not reproduce fit's failure" in d.verified, d.verified
    floor = float(d.remedy.split("return max(rate, ")[1].split(")")[0])
    model, x, y = _regression(0.05)
    history = model.fit(x, y, batch_size=16, epochs=40, verbose=0, shuffle=False, callbacks=[
        keras.callbacks.LearningRateScheduler(lambda epoch, rate: max(decay(epoch, rate), floor))])
    assert np.isfinite(history.history["loss"]).all()
