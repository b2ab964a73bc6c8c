"""Tests of the NaN doctor: diagnose, Diagnosis, CAUSES, NaNDoctor and train's first-skip diagnosis."""

from __future__ import annotations

import inspect
import json
import pathlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from companion.diagnostics import (
    CAUSES,
    Diagnosis,
    NaNDoctor,
    diagnose,
    diagnose_function,
    locate_nonfinite,
)
from companion.diagnostics.trace import OpTracer
from companion.training import SkippedStep, train

ROOT = pathlib.Path(__file__).resolve().parents[2]


class Root(keras.layers.Layer):
    """sqrt(w x): its gradient with respect to w is x / (2 sqrt(w x)) = 0 * inf at x = 0."""

    def build(self, shape):
        self.w = self.add_weight(shape=(), initializer="ones", name="w")

    def call(self, x):
        return tf.sqrt(self.w * x)  # the root line


def root_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((1,)), Root(name="root"), keras.layers.Dense(1, name="head")], name="net")


def root_line() -> int:
    import inspect

    lines, start = inspect.getsourcelines(Root.call)
    return start + next(i for i, line in enumerate(lines) if "the root line" in line)


def poisoned(n: int = 16, bad: int = 9) -> tuple[np.ndarray, np.ndarray]:
    x = np.linspace(1.0, 2.0, n, dtype="float32")[:, None]
    x[bad] = 0.0
    return x, np.ones((n, 1), "float32")


# --------------------------------------------------------------------------------------
# TensorFlow's op-callback chain
# --------------------------------------------------------------------------------------


def test_the_tracer_hands_graph_ops_their_outputs_unchanged():
    tracer = OpTracer()
    graph = tf.Graph()
    with graph.as_default():
        outputs = (tf.constant(1.0),)
    assert tracer(b"Const", (), (), outputs, op_name="c", graph=graph) is outputs


def test_no_callback_of_ours_breaks_tensorflows_callback_chain():
    """check-numerics registered after our callback receives what ours returns as outputs."""

    def mapped_dataset():
        tf.debugging.enable_check_numerics()  # registered after ours: it gets our return value
        try:
            data = tf.data.Dataset.range(4).map(lambda v: tf.cast(v, tf.float32) * 2.0)  # graph ops
            return float(sum(float(v) for v in data))
        finally:
            tf.debugging.disable_check_numerics()

    assert mapped_dataset() == 12.0
    assert locate_nonfinite(mapped_dataset) is None
    assert diagnose_function(mapped_dataset) is None
    # ... and the user's own check-numerics, on all along, survives fit on arrays (a dataset.map).
    tf.debugging.enable_check_numerics()
    try:
        model = root_model()
        model.compile(loss="mse", optimizer=keras.optimizers.SGD(1e-3), jit_compile=False)
        x, y = poisoned()
        x[9] = 1.0
        doctor = NaNDoctor(verbose=False)
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[doctor])
        assert doctor.diagnosis is None
        assert diagnose(model, (x, y)) is None
    finally:
        tf.debugging.disable_check_numerics()


# --------------------------------------------------------------------------------------
# diagnose
# --------------------------------------------------------------------------------------


def test_diagnose_names_batch_op_forward_op_layer_line_variables_and_cause():
    x, y = poisoned()
    d = diagnose(root_model(), (x, y), "mse", batch_size=4)
    assert isinstance(d, Diagnosis)
    assert (d.batch, d.phase, d.op, d.forward_op, d.layer) == (2, "backward", "SqrtGrad", "Sqrt", "net/root")
    assert d.source == f"{__file__}:{root_line()}" and d.code.startswith("return tf.sqrt(self.w * x)")
    assert d.variables == ("net/root/w",) and d.dtype == "float32"
    assert d.inputs_summary == "1 of 4 inputs of Sqrt are exactly 0"
    assert d.symptom == "finite loss, non-finite gradients" and d.mode_disagreement is None
    assert (d.cause, d.fix, d.section) == ("singular_derivative", *CAUSES["singular_derivative"][1:])


def test_diagnose_takes_data_as_fit_does():
    x, y = poisoned()
    model = root_model()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return x[4 * i:4 * i + 4], y[4 * i:4 * i + 4]

    found = [
        diagnose(model, dataset, "mse").batch,
        diagnose(model, x, "mse", y=y, batch_size=4).batch,
        diagnose(model, Batches(), "mse").batch,
        diagnose(model, ((x[i:i + 4], y[i:i + 4]) for i in range(0, 16, 4)), "mse").batch,
        diagnose(model, (x[8:12], y[8:12]), "mse").batch,  # one batch
        diagnose(model, (x, y), "mse").batch,  # fit's default batch size, 32: one batch
    ]
    assert found == [2, 2, 2, 2, 0, 0]
    assert diagnose(model, dataset, "mse", max_batches=2) is None
    assert diagnose(model, dataset, "mse", skip_batches=3) is None


def test_diagnose_uses_the_compiled_loss_with_sample_weights_and_several_outputs():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((1,))
    a = keras.layers.Dense(1, name="a")(inputs)
    b = keras.layers.Dense(1, activation="relu", kernel_initializer="zeros", name="b")(inputs)
    model = keras.Model(inputs, {"a": a, "b": b}, name="two")

    def log_loss(y, p):
        return -tf.math.log(p)  # a log of the ReLU head

    model.compile(loss={"a": "mse", "b": log_loss}, loss_weights={"a": 1.0, "b": 0.5}, optimizer="sgd")
    x = np.ones((4, 1), "float32")
    d = diagnose(model, (x, {"a": x, "b": x}, np.ones(4, "float32")))
    assert (d.phase, d.op, d.cause) == ("loss", "Log", "log_of_zero")
    assert d.symptom == "non-finite loss" and set(d.variables) == {"b/kernel", "b/bias"}
    with pytest.raises(ValueError, match="not compiled with a loss: pass loss="):
        diagnose(root_model(), (x, x))


def test_diagnose_checks_inputs_and_weights_before_the_op_by_op_run():
    x, y = poisoned()
    y[13] = np.nan
    d = diagnose(root_model(), (x, y), "mse", batch_size=4)
    # Batch 2 (x = 0 in row 9) comes first and is an op problem; batch 3 is a data problem.
    assert d.batch == 2
    d = diagnose(root_model(), (x, y), "mse", batch_size=4, skip_batches=3)
    assert (d.batch, d.phase, d.cause, d.op) == (3, "input", "nonfinite_input", None)
    assert d.inputs_summary == "1 of 4 entries of y are not finite (1 NaN); row 1"
    model = root_model()
    model.get_layer("head").kernel.assign([[np.inf]])  # set before any step: no step can cure it
    d = diagnose(model, (np.ones((4, 1), "float32"), np.ones((4, 1), "float32")), "mse")
    assert (d.phase, d.cause, d.layer, d.variables) == ("weights", "nonfinite_init", "net/head", ("net/head/kernel",))
    assert d.inputs_summary.startswith("1 of 1 entries of net/head/kernel are +Inf before any training step")
    assert d.source == f"{__file__}:{inspect.currentframe().f_lineno - 4}"
    model.compile(optimizer="sgd", loss="mse")
    model.optimizer.iterations.assign(1)  # a step has run: a step wrote it
    d = diagnose(model, (np.ones((4, 1), "float32"), np.ones((4, 1), "float32")), "mse")
    assert (d.phase, d.cause) == ("weights", "nonfinite_weights")
    assert d.inputs_summary.startswith("1 of 1 entries of net/head/kernel are not finite")
    d = diagnose(model, (np.ones((4, 1), "float32"),) * 2, "mse", losses_before=[1.0, 30.0, 900.0])
    assert d.cause == "divergence"


def test_diagnose_returns_none_on_clean_data_and_changes_nothing():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3), keras.layers.BatchNormalization()])
    before = [v.numpy().copy() for v in model.variables]
    data = (np.random.default_rng(0).normal(size=(8, 2)).astype("float32"), np.zeros((8, 3), "float32"))
    assert diagnose(model, data, "mse", batch_size=4) is None
    assert all(np.array_equal(v.numpy(), b) for v, b in zip(model.variables, before))
    assert not tf.config.functions_run_eagerly()


def test_diagnose_says_when_xla_makes_a_nan_the_op_by_op_run_does_not():
    # XLA differentiates where(x > 0, sqrt(x), 0) at 0 to NaN; eager TensorFlow's SqrtGrad
    # maps the 0 * inf of the unselected branch to 0 (tensorflow/tensorflow#118674).
    class SafeRoot(Root):
        def call(self, x):
            z = self.w * x
            return tf.where(z > 0, tf.sqrt(z), tf.zeros_like(z))

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), SafeRoot(name="root")], name="net")
    model.compile(loss="mse", optimizer="sgd", jit_compile=True)
    x, y = poisoned()
    d = diagnose(model, (x, y), batch_size=4)
    assert (d.batch, d.cause, d.op) == (2, "compiled_only", None)
    assert d.mode_disagreement == (
        "the XLA-compiled step is non-finite on batch 2 (finite loss, non-finite gradients); "
        "the op-by-op re-run is finite"
    )
    assert diagnose(model, (x, y), batch_size=4, jit_compile=False) is None


def test_diagnose_says_when_only_the_step_without_xla_makes_a_nan():
    # sqrt(relu(z)) with the unit off: without XLA, ReluGrad multiplies the Inf of
    # SqrtGrad by 0 (NaN); XLA's ReLU gradient is a select (0).
    class ReluRoot(Root):
        def call(self, x):
            return tf.sqrt(tf.nn.relu(self.w * x))  # the relu root line

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), ReluRoot(name="relu_root")], name="net")
    model.compile(loss="mse", optimizer="sgd", jit_compile=True)
    data = (-np.ones((4, 1), "float32"), np.ones((4, 1), "float32"))
    d = diagnose(model, data)
    assert (d.cause, d.op, d.forward_op, d.layer) == ("singular_derivative", "SqrtGrad", "Sqrt", "net/relu_root")
    assert d.mode_disagreement.startswith("the XLA-compiled step is finite on batch 0; the step without XLA")
    assert diagnose(model, data, jit_compile=False).mode_disagreement is None


def test_diagnose_rejects_bad_arguments():
    with pytest.raises(TypeError, match="model must be a Keras model, got function"):
        diagnose(lambda x: x, (1, 2), "mse")
    with pytest.raises(TypeError, match="data must be a tf.data.Dataset"):
        diagnose(root_model(), 3, "mse")
    with pytest.raises(ValueError, match="same number of samples"):
        diagnose(root_model(), (np.ones((4, 1)), np.ones((3, 1))), "mse")


# --------------------------------------------------------------------------------------
# Complex intermediates and custom loops
# --------------------------------------------------------------------------------------


def test_locate_and_diagnose_see_the_complex_reciprocal_inside_angles_gradient():
    w = tf.Variable([0.0, 0.0])

    def step():
        with tf.GradientTape() as tape:
            loss = tf.math.angle(tf.complex(w[0], w[1]))
        return tape.gradient(loss, w)

    where = locate_nonfinite(step)
    assert (where.op_type, where.gradient_of, where.dtype) == ("Reciprocal", "Angle", "complex64")
    d = diagnose_function(tf.function(step))
    assert (d.op, d.forward_op, d.cause, d.dtype) == ("Reciprocal", "Angle", "singular_derivative", "complex64")


# --------------------------------------------------------------------------------------
# The report, the causes
# --------------------------------------------------------------------------------------


def test_a_diagnosis_prints_in_lines_of_80_characters_and_renders_as_html():
    d = diagnose(root_model(), poisoned(), "mse", batch_size=4)
    text = str(d)
    assert text.splitlines()[0] == "NaN doctor: singular_derivative in SqrtGrad"
    assert max(len(line) for line in text.splitlines()) <= 80
    for expected in ("SqrtGrad (gradient of Sqrt)", "net/root", f"test_doctor.py:{root_line()}", "net/root/w"):
        assert expected in text
    html = d._repr_html_()
    assert html.startswith("<table") and html.endswith("</table>")
    for label in ("batch", "phase", "op", "layer", "line", "inputs", "variables", "cause", "fix", "book"):
        assert f">{label}</th>" in html
    assert "SqrtGrad (gradient of Sqrt)" in html
    assert Diagnosis.from_dict(json.loads(json.dumps(d.to_dict()))) == d


#: The causes as released (tests/data/causes.txt): the one frozen copy of the names.
RELEASED_CAUSES = [
    line for line in (ROOT / "tests" / "data" / "causes.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]


def test_no_cause_is_ever_renamed_or_removed_and_a_new_one_is_recorded():
    gone = [name for name in RELEASED_CAUSES if name not in CAUSES]
    assert not gone, f"causes renamed or removed (tools rely on the names): {gone}"
    new = [name for name in CAUSES if name not in RELEASED_CAUSES]
    assert not new, f"append the new causes to tests/data/causes.txt: {new}"
    assert len(set(RELEASED_CAUSES)) == len(RELEASED_CAUSES)


def test_every_cause_is_named_by_a_recognition_rule_or_says_where_it_is_recognised():
    from companion.diagnostics import causes

    by_rules = {rule.cause for rule in causes.RULES}
    assert by_rules <= set(CAUSES) and set(causes.RECOGNISED_ELSEWHERE) <= set(CAUSES)
    unrecognised = set(CAUSES) - by_rules - set(causes.RECOGNISED_ELSEWHERE)
    assert not unrecognised, f"add a rule to causes.RULES or an entry to RECOGNISED_ELSEWHERE: {unrecognised}"
    # what RECOGNISED_ELSEWHERE claims: the name is returned somewhere besides CAUSES itself
    sources = "".join(p.read_text() for p in (ROOT / "companion" / "diagnostics").glob("*.py"))
    for name in set(causes.RECOGNISED_ELSEWHERE) - by_rules:
        assert sources.count(f'"{name}"') >= 2, f"{name}: nothing in companion/diagnostics names it"


def test_the_rules_of_one_op_are_tried_in_order_the_first_that_holds_names_the_cause():
    from companion.diagnostics.causes import _forward_cause

    x = np.array([0.0, -1.0, 2.0], np.float32)
    assert _forward_cause("Log", [x], None, in_backward=False) == ("log_of_zero", "1 of 3 inputs of Log are exactly 0")
    assert _forward_cause("Log", [x[1:]], None, in_backward=False)[0] == "domain_edge"
    # a rule for the backward pass only: sqrt at 0 is finite forward
    assert _forward_cause("Sqrt", [np.float32([0.0, 1.0])], None, in_backward=False)[0] == "unclassified"
    assert _forward_cause("Sqrt", [np.float32([0.0, 1.0])], None, in_backward=True)[0] == "singular_derivative"
    # an integer power of a negative base is finite forward, its gradient in p is not
    pow_inputs = [np.float32([-2.0]), np.float32([2.0])]
    assert _forward_cause("Pow", pow_inputs, None, in_backward=False)[0] == "unclassified"
    assert _forward_cause("Pow", pow_inputs, None, in_backward=True)[0] == "pow_negative_base"


def _anchors(notebook: pathlib.Path) -> set[str]:
    # The book's heading anchors are docutils' ids (_config.yml: myst_heading_slug_func);
    # docutils comes with the book's tools, which the other stacks do not install.
    make_id = pytest.importorskip("docutils.nodes").make_id
    cells = json.loads(notebook.read_text())["cells"]
    headings = [
        line.lstrip("#").strip()
        for cell in cells
        if cell["cell_type"] == "markdown"
        for line in "".join(cell["source"]).splitlines()
        if line.startswith("#")
    ]
    return {make_id(re.sub(r"[`$]", "", heading)) for heading in headings}


def test_every_cause_has_a_fix_and_a_section_that_exists_in_the_book():
    for name, (description, fix, section) in CAUSES.items():
        assert description and fix, name
        chapter, _, anchor = section.partition("#")
        notebook = ROOT / f"{chapter}.ipynb"
        assert notebook.exists(), f"{name}: {chapter}"
        assert anchor in _anchors(notebook), f"{name}: no heading #{anchor} in {chapter}"


# --------------------------------------------------------------------------------------
# In the loops: NaNDoctor for fit, the first skipped step of train
# --------------------------------------------------------------------------------------


def test_nandoctor_diagnoses_fits_first_nan_restores_the_last_finite_weights_and_stops():
    x, y = poisoned()
    model = root_model()
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(1e-3))
    doctor = NaNDoctor(verbose=False)
    history = model.fit(x, y, batch_size=4, epochs=5, shuffle=False, verbose=0, callbacks=[doctor])
    d = doctor.diagnosis
    assert (d.op, d.layer, d.cause, d.batch) == ("SqrtGrad", "net/root", "singular_derivative", 2)
    assert doctor.batch == (0, 2)  # its loss was finite; the NaN weights it left made batch 3's loss NaN
    assert len(history.history["loss"]) == 1  # stopped in the first epoch
    assert all(np.isfinite(v.numpy()).all() for v in model.variables)


def test_train_diagnoses_its_first_skipped_step_only(capsys):
    x, y = poisoned()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    history = train(root_model(), data, loss="mse", optimizer=keras.optimizers.SGD(1e-3), epochs=2, verbose=2)
    assert history.skipped == [2, 6]
    first, second = history.reports
    assert (first.diagnosis.op, first.diagnosis.layer, first.diagnosis.cause) == (
        "SqrtGrad", "net/root", "singular_derivative",
    )
    assert first.diagnosis.batch == 2 and second.diagnosis is None
    assert "NaN doctor: singular_derivative in SqrtGrad" in capsys.readouterr().out
    assert SkippedStep.from_dict(json.loads(json.dumps(first.to_dict()))).diagnosis == first.diagnosis


def test_the_doctor_leaves_every_variable_and_seed_generator_bit_identical():
    # Batch normalisation's statistics and dropout's seed generator change in a call
    # with training=True; the doctor's scans and its op-by-op re-run must undo it.
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((1,)), Root(name="root"), keras.layers.BatchNormalization(), keras.layers.Dropout(0.5),
         keras.layers.Dense(1)], name="net",
    )
    model(np.ones((2, 1), "float32"))
    generators = [v for v in model.non_trainable_variables if "seed_generator" in v.path]
    assert generators  # the dropout's state is among the variables the doctor restores
    before = [np.array(v.numpy()).tobytes() for v in model.variables]
    x, y = poisoned()
    d = diagnose(model, (x, y), "mse", batch_size=4)
    assert (d.batch, d.op) == (2, "SqrtGrad")
    assert [np.array(v.numpy()).tobytes() for v in model.variables] == before


def test_train_calls_the_doctor_on_no_step_that_is_not_skipped(monkeypatch):
    from companion.training import callbacks

    calls = []
    monkeypatch.setattr(callbacks, "diagnose_skipped_step", lambda run, step: calls.append(step))
    x, y = poisoned()
    x[9] = 1.0
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    history = train(root_model(), data, loss="mse", optimizer=keras.optimizers.SGD(1e-3), epochs=2, verbose=0)
    assert history.skipped == [] and calls == []


MIRRORED_SCRIPT = r"""
import json, os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf

cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)

import keras
import numpy as np
from companion.training import train

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
x = np.linspace(1.0, 2.0, 32, dtype="float32")[:, None]
y = np.ones((32, 1), "float32")
x[8 + 6] = 0.0  # global batch 8 is split 4 + 4: row 6 of batch 1 goes to replica 1 only
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)


class Root(keras.layers.Layer):
    def build(self, shape):
        self.w = self.add_weight(shape=(), initializer="ones", name="w")

    def call(self, x):
        return tf.sqrt(self.w * x)


keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([keras.Input((1,)), Root(name="root"), keras.layers.Dense(1)], name="net")
    optimizer = keras.optimizers.SGD(1e-3)
history = train(model, data, loss="mse", optimizer=optimizer, strategy=strategy, epochs=1, verbose=0)
d = history.reports[0].diagnosis
print("RESULT " + json.dumps({"skipped": history.skipped, "diagnosis": d and d.to_dict()}))
"""


@pytest.mark.slow
def test_train_under_mirrored_strategy_names_the_replica_whose_shard_made_the_nan():
    import os
    import subprocess
    import sys

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONHASHSEED="0")
    completed = subprocess.run(
        [sys.executable, "-c", MIRRORED_SCRIPT], capture_output=True, text=True, timeout=300, env=env
    )
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    assert completed.returncode == 0 and lines, completed.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["skipped"] == [1]
    d = result["diagnosis"]
    assert (d["op"], d["layer"], d["cause"], d["batch"]) == ("SqrtGrad", "net/root", "singular_derivative", 1)
    assert d["inputs_summary"] == "replica 1: 1 of 4 inputs of Sqrt are exactly 0"
