"""Canary tests of companion._internal: at least one per private TensorFlow/Keras hook.

Each test fails loudly when an upgrade of TensorFlow or Keras removes the private name
a hook relies on, or stops calling it, so the hook is updated instead of the package
silently taking its slower or less informative fall-back.
"""

from __future__ import annotations

import ast
import sys
import threading
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from companion import _internal
from companion._internal import keras_trainer
from companion.diagnostics import locate_nonfinite


def _sgd_apply_graph(optimizer, variable):
    @tf.function(autograph=False)
    def apply(gradient):
        optimizer.apply([gradient], [variable])

    return apply.get_concrete_function(tf.TensorSpec(variable.shape, variable.dtype))


def test_every_write_of_a_keras_optimizer_update_goes_through_the_interceptor():
    variable = keras.Variable(np.ones(3, "float32"))
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    optimizer.build([variable])
    seen = []

    def rewrite(old, new):
        seen.append(new.dtype)
        return new

    assert _internal.variable_writes_interceptable()
    with _internal.intercept_variable_writes(rewrite):
        graph = _sgd_apply_graph(optimizer, variable).graph
    assigns = [op for op in graph.get_operations() if op.type == "AssignVariableOp"]
    # The weight, the momentum and the iteration counter, each written through the hook.
    assert len(seen) >= 3 and len(seen) == len(assigns)
    assert not _internal.variable_writes_patched()


def test_the_write_interceptor_is_removed_when_two_threads_trace_at_once():
    inside = threading.Barrier(2)
    errors = []

    def trace(leave_after: float):
        try:
            with _internal.intercept_variable_writes(lambda old, new: new):
                inside.wait(timeout=30)
                threading.Event().wait(leave_after)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=trace, args=(delay,)) for delay in (0.05, 0.2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    assert not _internal.variable_writes_patched()


def test_writes_of_a_thread_that_did_not_ask_are_not_rewritten():
    variable = tf.Variable(1.0)
    entered, done = threading.Event(), threading.Event()

    def hold():
        with _internal.intercept_variable_writes(lambda old, new: old):  # would drop every write
            entered.set()
            done.wait(timeout=30)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert entered.wait(timeout=30)
        assert _internal.variable_writes_patched()
        tf.function(lambda: variable.assign(5.0), autograph=False)()
        assert float(variable.numpy()) == 5.0
    finally:
        done.set()
        thread.join(timeout=30)


def test_keras_optimizers_all_reduce_through_the_method_the_loop_overrides():
    variable = keras.Variable(np.ones(2, "float32"))
    optimizer = keras.optimizers.SGD(0.5)
    optimizer.build([variable])
    with warnings.catch_warnings():
        warnings.simplefilter("error", _internal.InternalAPIWarning)
        assert _internal.can_skip_optimizer_all_reduce(optimizer)
    calls = []
    original = type(optimizer)._all_reduce_sum_gradients

    def counting(self, pairs):
        calls.append(len(list(pairs)))
        return original(self, pairs)

    optimizer._all_reduce_sum_gradients = counting.__get__(optimizer)
    optimizer.apply([tf.ones(2)], [variable])
    assert calls == [1]  # Keras still calls it, so the loop's override takes effect
    del optimizer._all_reduce_sum_gradients
    with _internal.optimizer_all_reduce_skipped(optimizer):
        assert optimizer._all_reduce_sum_gradients([(1, 2)]) == [(1, 2)]
    assert "_all_reduce_sum_gradients" not in vars(optimizer)


def test_keras_optimizers_keep_the_learning_rate_as_given():
    with warnings.catch_warnings():
        warnings.simplefilter("error", _internal.InternalAPIWarning)
        sgd = keras.optimizers.SGD(0.5)
        rate = _internal.learning_rate_as_given(sgd)
        schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
        found = _internal.learning_rate_as_given(keras.optimizers.Adam(schedule))
    # A variable (Keras 3.5's backend variables are not instances of keras.Variable).
    assert callable(getattr(rate, "assign", None)) and float(rate.numpy()) == 0.5
    assert any(rate is v for v in sgd.variables)  # the optimizer's own, which a rollback assigns
    assert found is schedule


def test_keras_optimizers_keep_the_variables_they_were_built_on():
    first, second = keras.Variable(np.ones(3, "float32")), keras.Variable(np.ones((2, 2), "float32"))
    optimizer = keras.optimizers.Adam()
    optimizer.build([first, second])
    with warnings.catch_warnings():
        warnings.simplefilter("error", _internal.InternalAPIWarning)
        built_on = _internal.variables_built_on(optimizer)
    assert len(built_on) == 2 and built_on[0] is first and built_on[1] is second


def test_keras_layers_flatten_nested_layers():
    inner = keras.Sequential([keras.layers.Dense(2)])
    model = keras.Sequential([keras.Input((3,)), inner, keras.layers.Dense(1)])
    assert hasattr(model, "_flatten_layers")
    layers = _internal.all_layers(model)
    dense = [layer for layer in layers if isinstance(layer, keras.layers.Dense)]
    assert model in layers and inner in layers and len(dense) == 2


def test_strategies_say_whether_they_span_several_workers():
    assert callable(getattr(tf.distribute.get_strategy().extended, "_in_multi_worker_mode", None))
    with warnings.catch_warnings():
        warnings.simplefilter("error", _internal.InternalAPIWarning)
        assert not _internal.in_multi_worker_mode(tf.distribute.get_strategy())


def test_replica_context_all_reduce_support_is_reported():
    with warnings.catch_warnings():
        warnings.simplefilter("error", _internal.InternalAPIWarning)
        assert _internal.strategy_supports_no_merge_call() in (True, False)
    assert callable(tf.__internal__.distribute.strategy_supports_no_merge_call)


def test_op_callbacks_see_eager_ops_and_check_numerics_state_is_readable():
    seen = []
    with _internal.op_callback(lambda op_type, *args, **kwargs: seen.append(op_type)) as registered:
        tf.math.log(tf.constant(2.0))
    assert registered and any(b"Log" in t if isinstance(t, bytes) else "Log" in str(t) for t in seen)
    assert _internal.check_numerics_enabled() is False
    tf.debugging.enable_check_numerics()
    try:
        assert _internal.check_numerics_enabled() is True
    finally:
        tf.debugging.disable_check_numerics()


def test_eager_backprop_names_the_forward_op_of_a_failing_gradient():
    x = tf.Variable([0.0, 1.0])

    def step():
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(tf.sqrt(x))
        return tape.gradient(y, x)

    where = locate_nonfinite(step)
    # phase and gradient_of from backprop._gradient_function's locals, seen by an op callback
    assert (where.op_type, where.phase, where.gradient_of) == ("SqrtGrad", "gradient", "Sqrt")
    assert (where.dtype, where.shape, where.inf_count) == ("float32", (2,), 1)


def test_eager_backprop_exposes_the_forward_op_and_its_tensors_to_op_callbacks():
    seen = []

    def callback(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        frame = sys._getframe(1)
        seen.append((op_type, _internal.backprop_forward_op(frame), _internal.in_backprop(frame)))
        return outputs

    x = tf.Variable([4.0])
    with tf.GradientTape() as tape:
        y = tf.sqrt(x)
    with _internal.op_callback(callback):
        tape.gradient(y, x)
    (_, forward, inside), *_ = [s for s in seen if s[0] in ("SqrtGrad", b"SqrtGrad")]
    assert forward["op_type"] == "Sqrt" and inside
    assert any(t is not None and float(t.numpy()[0]) == 2.0 for t in forward["outputs"])
    assert _internal.backprop_forward_op(sys._getframe()) is None
    assert not _internal.in_backprop(sys._getframe())


def test_the_ops_inside_a_functional_op_are_readable():
    # An LSTM's loop reads its kernel; a loop that assigns a variable writes one.
    layer = keras.layers.LSTM(4)
    layer.build((2, 5, 3))
    counter = tf.Variable(0.0)

    def body(i, total):
        counter.assign_add(1.0)
        return i + 1, total + 1.0

    @tf.function(autograph=False)
    def step(x):
        tf.while_loop(lambda i, total: i < 3, body, [0, 0.0])
        return layer(x)

    graph = step.get_concrete_function(tf.TensorSpec([2, 5, 3])).graph
    loops = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
    verdicts = sorted(_internal.functional_op_writes(op) for op in loops)
    assert verdicts == [False, True]


def test_op_determinism_can_be_read_and_turned_off():
    was = _internal.op_determinism_enabled()
    try:
        tf.config.experimental.enable_op_determinism()
        assert _internal.op_determinism_enabled() is True
        _internal.disable_op_determinism()
        assert _internal.op_determinism_enabled() is False
    finally:
        if was:
            tf.config.experimental.enable_op_determinism()


def test_a_debugger_v2_dump_can_be_read(tmp_path):
    reader_module = _internal.debug_events_reader()
    writer = tf.debugging.experimental.enable_dump_debug_info(
        str(tmp_path), tensor_debug_mode="FULL_HEALTH", circular_buffer_size=-1)
    try:
        tf.function(lambda x: tf.math.log(x))(tf.constant([0.0, 1.0]))
    finally:
        writer.FlushNonExecutionFiles()
        writer.FlushExecutionFiles()
        tf.debugging.experimental.disable_dump_debug_info()
    with reader_module.DebugDataReader(str(tmp_path)) as reader:
        reader.update()
        ops = [trace.op_type for trace in reader.graph_execution_traces()
               if any(reader.graph_execution_trace_to_tensor_value(trace)[5:8])]
    assert "Log" in ops  # log(0) = -inf, seen in the dump


def test_keras_fit_is_on_the_stack_of_a_callback_with_its_arguments():
    found = []

    class Peek(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            found.append(_internal.running_fit_arguments(sys._getframe(1)))

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="sgd")
    x = np.ones((4, 1), "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error", _internal.InternalAPIWarning)
        model.fit(x, x, batch_size=2, epochs=1, verbose=0, callbacks=[Peek()])
    assert found[0]["x"] is x and found[0]["batch_size"] == 2


def test_keras_fit_shuffled_batches_can_be_tapped_in_the_order_fit_trains_on_them():
    tapped, trained = [], []

    class Tap(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.remove = _internal.tap_fit_batches(sys._getframe(1), tapped.append)

        def on_train_batch_end(self, batch, logs=None):
            if batch % 2:
                self.remove.collect()  # (fit's steps go on while some batches wait in the tap)

        def on_train_end(self, logs=None):
            self.remove.collect()
            self.remove()

    class Seen(keras.layers.Layer):
        def call(self, x):
            if hasattr(x, "numpy"):  # the steps (run eagerly), not the symbolic build
                trained.append(x.numpy().copy())
            return x

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), Seen(), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="sgd", run_eagerly=True)
    x = np.arange(12, dtype="float32").reshape(12, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", _internal.InternalAPIWarning)
        model.fit(x, x, batch_size=4, epochs=2, shuffle=True, verbose=0, callbacks=[Tap()])
    assert len(tapped) == len(trained) == 6
    assert all(np.array_equal(t[0], s) for t, s in zip(tapped, trained))  # the same rows, in order
    assert not np.array_equal(np.concatenate([t[0] for t in tapped[:3]]), x)  # and fit did shuffle them


def test_xla_failure_text_is_recognised():
    @tf.function(jit_compile=True)
    def host_only(x):
        return tf.numpy_function(lambda a: a, [x], tf.float32)

    with pytest.raises(tf.errors.OpError) as caught:
        host_only(tf.constant([1.0]))
    assert _internal.looks_like_xla_failure(caught.value)
    assert _internal.xla_failure_summary(caught.value) == "no XLA kernel for PyFunc"


def test_collective_error_texts_are_summarised():
    text = (
        "{{function_node __inference_step_1}} Collective ops is aborted by: Socket closed\n"
        "Additional GRPC error information from remote target /job:worker/replica:0/task:1"
    )
    assert _internal.collective_error_summary(text) == "Socket closed"
    assert _internal.tasks_named_in(text + " /job:worker/replica:0/task:1") == ("/job:worker/replica:0/task:1",)


PRIVATE_MODULES = ("tensorflow.python", "keras.src", "tensorflow.core")
#: Names whose private attributes are our own: self/cls, companion's private modules and helpers.
OWN_OBJECTS = ("self", "cls", "companion", "_internal", "network", "run", "os", "sys")
NAME_FUNCTIONS = ("getattr", "setattr", "hasattr", "delattr")
#: Private attributes companion itself puts on its own objects, read by name.
OWN_PRIVATE_ATTRIBUTES = {"_capsule"}  # a Diagnosis's saved step (companion.diagnostics.diagnosis.keep_state)


def private_api_uses(source: str, where: str = "<source>") -> list[str]:
    """Every private TensorFlow/Keras module, attribute or ``tf.__internal__`` ``source`` names,
    as ``x._name``, or by a string: ``getattr(x, "_name")`` (and setattr/hasattr/delattr)."""
    offenders = []
    for node in ast.walk(ast.parse(source)):
        line = f"{where}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PRIVATE_MODULES):
            offenders.append(f"{line} imports {node.module}")
        elif isinstance(node, ast.Import):
            offenders += [f"{line} imports {a.name}" for a in node.names if a.name.startswith(PRIVATE_MODULES[:2])]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in OWN_OBJECTS):
                offenders.append(f"{line} uses .{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr == "__internal__":
            offenders.append(f"{line} uses tf.__internal__")
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in NAME_FUNCTIONS
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
        ):
            owner, name = node.args[0], node.args[1].value
            own = (isinstance(owner, ast.Name) and owner.id in OWN_OBJECTS) or name in OWN_PRIVATE_ATTRIBUTES
            if name.startswith("_") and not name.startswith("__") and not own:
                offenders.append(f"{line} uses {node.func.id}(..., {name!r})")
    return offenders


def test_only_the_internals_package_names_private_tensorflow_or_keras_apis():
    import pathlib

    import companion

    root = pathlib.Path(companion.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if root / "_internal" in path.parents:
            continue
        offenders += private_api_uses(path.read_text(), str(path.relative_to(root)))
    assert not offenders, "\n".join(offenders)


def test_the_private_name_check_sees_every_spelling():
    source = (
        "from keras.src import ops\n"
        "import tensorflow.python.eager\n"
        "model._flatten_layers()\n"
        "getattr(model, '_symbolic_build', None)\n"
        "hasattr(optimizer, '_trainable_variables')\n"
        "setattr(model, '_maybe_symbolic_build', f)\n"
        "tf.__internal__.distribute\n"
        "getattr(self, '_own', None)\n"  # our own object: allowed
        "getattr(model, '__class__')\n"  # dunder: allowed
    )
    found = private_api_uses(source)
    assert len(found) == 7, found
    assert any("getattr(..., '_symbolic_build')" in f for f in found)
    assert any("hasattr(..., '_trainable_variables')" in f for f in found)
    assert any("setattr(..., '_maybe_symbolic_build')" in f for f in found)


def test_keras_builds_compiled_metrics_from_an_element_spec():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(), loss="mse", metrics=["mae"])
    assert callable(getattr(model, "_symbolic_build", None))
    spec = (tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([None, 1], tf.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error", _internal.InternalAPIWarning)
        _internal.build_compiled_state(model, spec)
    assert sorted(model.get_metrics_result()) == ["loss", "mae"]
    assert len(model.metrics_variables) == 4  # loss total/count, mae total/count: built before any step


def test_keras_defines_its_train_step_in_its_own_modules_and_fit_builds_an_own_step_model_in_it():
    # own_step_unbuilt tells Keras' train_step from a model's own by the module of the class
    # that defines it, and relies on fit building nothing before such a model's first step.
    keras_step = next(k for k in type(keras.Sequential()).__mro__ if "train_step" in vars(k))
    assert keras_step.__module__.startswith("keras.")

    class OwnStep(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, inputs):
            return self.dense(inputs)

        def train_step(self, data):
            x, y = data
            self.dense(tf.zeros([tf.shape(x)[0], 2]))  # a call on other inputs than the data
            return {"loss": tf.constant(0.0)}

    model = OwnStep()
    model.compile(optimizer="sgd")
    assert _internal.own_step_unbuilt(model)
    assert not _internal.own_step_unbuilt(keras.Sequential([keras.layers.Dense(1)]))
    model.fit(np.zeros((4, 3), "float32"), np.zeros((4, 1), "float32"), verbose=0)
    assert model.dense.kernel.shape == (2, 1)  # built by the step, not by the data's shape


def test_restore_on_create_passes_a_checkpoint_value_that_is_recognised():
    # A variable created after `restore()` (Keras' and tf.Module's "restore on create")
    # receives its checkpoint value as initial_value through every variable creator;
    # companion.book.notebook's ulp perturbation must recognise it and leave it alone.
    import tempfile

    from tensorflow.python.trackable import autotrackable  # the canary names the private class

    seen = []

    def spy(next_creator, **kwargs):
        seen.append(_internal.is_checkpoint_restore(kwargs["initial_value"]))
        return next_creator(**kwargs)

    with tempfile.TemporaryDirectory() as folder:
        saved = autotrackable.AutoTrackable()
        saved.v = tf.Variable([0.25, 0.5])
        path = tf.train.Checkpoint(root=saved).save(folder + "/ckpt")
        fresh = autotrackable.AutoTrackable()
        tf.train.Checkpoint(root=fresh).restore(path)
        with tf.variable_creator_scope(spy):
            fresh.v = fresh._add_variable_with_custom_getter(
                "v", getter=lambda name, shape, dtype, initializer, **kw: tf.Variable(initializer, name=name),
                shape=[2], dtype=tf.float32, initializer=tf.zeros([2]))
    assert seen == [True], "restore on create no longer passes a recognisable checkpoint value"
    np.testing.assert_array_equal(fresh.v.numpy(), [0.25, 0.5])
    assert not _internal.is_checkpoint_restore(tf.zeros([2]))
    assert not _internal.is_checkpoint_restore(lambda: tf.zeros([2]))


def test_the_global_random_states_are_found_and_move_when_drawn_from():
    import keras

    keras.random.normal((1,))  # creates Keras' global SeedGenerator if needed
    tf.random.get_global_generator()
    with warnings.catch_warnings():
        warnings.simplefilter("error", _internal.InternalAPIWarning)
        states = _internal.global_random_states()
    assert len(states) == 2
    before = [np.array(s.numpy()) for s in states]
    keras.random.normal((1,))
    tf.random.get_global_generator().normal((1,))
    after = [np.array(s.numpy()) for s in states]
    assert all(not np.array_equal(a, b) for a, b in zip(before, after))


def test_keras_multi_step_loop_says_whether_it_ends_short_calls():
    import warnings

    import keras
    import numpy as np

    with warnings.catch_warnings():
        warnings.simplefilter("error", _internal.InternalAPIWarning)
        ends_short = _internal.multi_step_loop_ends_short_calls()
    # What the hook reads must be what Keras does: a validation pass of 1 batch under
    # steps_per_execution=4 is logged only by a Keras that ends short calls.
    x = np.ones((8, 1), "float32")
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="sgd", steps_per_execution=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = model.fit(x, x, batch_size=2, validation_data=(x[:2], x[:2]), verbose=0)
    assert ("val_loss" in history.history) == ends_short
    if tuple(int(p) for p in keras.__version__.split(".")[:2]) >= (3, 13):
        assert ends_short  # the lock's and Colab's Keras


def test_the_first_batch_of_either_keras_epoch_iterator_is_found():
    # Keras 3.15 iterates an epoch iterator as (begin, end, iterator); Keras 3.5 has only
    # enumerate_epoch() of (step, iterator) (the multi-worker chapter failed on it).
    class New:
        def __iter__(self):
            yield 0, 1, iter(["first", "second"])

    class Old:
        def enumerate_epoch(self):
            yield 0, iter(["first", "second"])

    assert keras_trainer._first_batch(New()) == "first"
    assert keras_trainer._first_batch(Old()) == "first"


def test_keras_marks_the_empty_callback_methods_as_defaults():
    if tuple(int(v) for v in keras.__version__.split(".")[:2]) < (3, 6):
        pytest.skip("Keras 3.5 has no _is_default mark: the hook falls back (and warns) there")
    assert getattr(keras.callbacks.Callback.on_train_batch_end, "_is_default", False)
    hooked = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", _internal.InternalAPIWarning)
        assert _internal.is_default_callback_method(keras.callbacks.Callback(), "on_train_batch_end")
        # LambdaCallback sets the hooks it is given on the instance: only those are not defaults
        assert not _internal.is_default_callback_method(hooked, "on_train_batch_end")
        assert _internal.is_default_callback_method(hooked, "on_test_batch_end")


def test_mirrored_strategy_keeps_collective_instance_keys_where_the_isolation_moves_them():
    strategy = tf.distribute.MirroredStrategy(tf.config.list_logical_devices("CPU")[:1])
    table = strategy.extended._collective_keys._instance_key_table
    assert isinstance(table, dict) and all(isinstance(k, int) for g in table.values() for k in g.values())
    before = {group: dict(keys) for group, keys in table.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", _internal.InternalAPIWarning)
        _internal.isolate_collective_keys(strategy)
        moved = {group: dict(keys) for group, keys in table.items()}
        _internal.isolate_collective_keys(strategy)  # once per strategy
    assert all(moved[g][d] > before[g][d] for g in before for d in before[g])
    assert {g: dict(k) for g, k in table.items()} == moved
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "MirroredStrategy eagerly has significant overhead"
        total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(2.0)), axis=None)
    assert float(total) == 2.0


def test_keras_fit_s_symbolic_build_repair_is_installed_and_undone_on_the_instance():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    assert callable(getattr(type(model), "_maybe_symbolic_build", None))
    with warnings.catch_warnings():
        warnings.simplefilter("error", _internal.InternalAPIWarning)
        _internal.repair_symbolic_build_for_multi_worker(model)
    assert "_maybe_symbolic_build" in vars(model)
    _internal.undo_symbolic_build_repair(model)
    assert "_maybe_symbolic_build" not in vars(model)


def test_keras_fit_and_evaluate_keep_and_reuse_their_step_functions_on_the_model():
    class Called(Exception):
        pass

    def called(iterator):
        raise Called

    x = np.ones((4, 2), "float32")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("error", _internal.InternalAPIWarning)
        names = _internal.step_function_attributes(model)
    assert names == ("train_function", "test_function")
    assert model.train_function is None and model.test_function is None
    model.fit(x, x[:, :1], verbose=0)
    model.evaluate(x, x[:, :1], verbose=0)
    assert callable(model.train_function) and callable(model.test_function)
    # what is there is what runs: fit and evaluate call it rather than compile anew
    model.train_function = called
    with pytest.raises(Called):
        model.fit(x, x[:, :1], verbose=0)
    model.test_function = called
    with pytest.raises(Called):
        model.evaluate(x, x[:, :1], verbose=0)
    # and None makes them compile a new one
    model.train_function = model.test_function = None
    model.fit(x, x[:, :1], validation_data=(x, x[:, :1]), verbose=0)
    assert callable(model.train_function) and model.train_function is not called


# --------------------------------------------------------------------------------------
# The registry: every hook has canaries, and they exist
# --------------------------------------------------------------------------------------


def _hook_functions() -> dict:
    """Every public function of the family modules of companion._internal (each of its modules
    but the registry, a new one included), by ``module.name``."""
    import importlib
    import inspect
    import pkgutil

    found = {}
    families = [info.name for info in pkgutil.iter_modules(_internal.__path__) if info.name != "registry"]
    assert {"variables", "keras_trainer", "distribute"} <= set(families), families
    for family in families:
        module = importlib.import_module(f"companion._internal.{family}")
        for name, value in vars(module).items():
            if inspect.isfunction(value) and value.__module__ == module.__name__ and not name.startswith("_"):
                found[f"{module.__name__}.{name}"] = value
    return found


def _tests_in(path) -> set[str]:
    return {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)
            and node.name.startswith("test_")}


def registry_problems(functions: dict, hooks: dict) -> list[str]:
    """What is wrong with a registry: a hook function not registered, a hook without a
    canary, a canary that names no test."""
    import pathlib

    here = pathlib.Path(__file__).resolve()
    root = here.parents[2]
    problems = [f"{name} is not registered: decorate it with @hook(<canary tests>)"
                for name in functions if name not in hooks]
    for name, entry in hooks.items():
        if not entry.canaries:
            problems.append(f"{name} has no canary test")
        for canary in entry.canaries:
            path, _, test = canary.rpartition("::")
            where = root / path if path else here
            if not where.is_file() or test not in _tests_in(where):
                problems.append(f"{name}: its canary {canary} does not exist")
    return problems


def test_every_hook_is_registered_with_canary_tests_that_exist():
    functions = _hook_functions()
    assert len(functions) >= 25
    assert set(_internal.HOOKS) == set(functions)
    assert not registry_problems(functions, _internal.HOOKS)


def test_a_hook_without_a_canary_or_with_a_missing_one_fails_the_registry_check():
    def private_thing():
        pass

    functions = {"companion._internal.fake.private_thing": private_thing}
    assert registry_problems(functions, {}) == [
        "companion._internal.fake.private_thing is not registered: decorate it with @hook(<canary tests>)"]
    without = {"companion._internal.fake.private_thing": _internal.Hook("companion._internal.fake", "private_thing", ())}
    assert registry_problems(functions, without) == ["companion._internal.fake.private_thing has no canary test"]
    missing = {"companion._internal.fake.private_thing": _internal.Hook(
        "companion._internal.fake", "private_thing", ("test_that_does_not_exist",))}
    assert registry_problems(functions, missing) == [
        "companion._internal.fake.private_thing: its canary test_that_does_not_exist does not exist"]


def test_internal_api_warnings_are_errors_in_the_test_suite(request):
    # (the other stacks pass -W default::... on the command line: an older Keras falls back)
    assert "error::companion._internal.registry.InternalAPIWarning" in request.config.getini("filterwarnings")
