"""Private TensorFlow/Keras APIs, one family: keras' trainer and layers: ``fit``'s frames, its symbolic build, its compiled state, its callbacks' defaults, its multi-step loop.

Each hook says what it relies on and what happens when it is gone, and is registered
(:func:`companion._internal.registry.hook`) with its canary tests.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import tensorflow as tf

from companion._internal.registry import hook, warn_once


# --------------------------------------------------------------------------------------
# Every layer of a model
# --------------------------------------------------------------------------------------
# Relies on: Keras 3's ``Layer._flatten_layers(include_self=True, recursive=True)``.
# If gone: a walk over the public ``layers`` attributes (which misses layers kept in
# plain attributes of a subclassed layer).


@hook('test_keras_layers_flatten_nested_layers')
def all_layers(model) -> list:
    """``model`` and every layer nested in it."""
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is not None:
        return list(flatten(include_self=True, recursive=True))
    warn_once("_flatten_layers", "keras layers have no _flatten_layers: nested layers are found through .layers only")
    found, pending = [], [model]
    while pending:
        layer = pending.pop()
        found.append(layer)
        pending.extend(getattr(layer, "layers", []) or [])
    return found


# --------------------------------------------------------------------------------------
# Building a compiled model's loss and metric state before the first step
# --------------------------------------------------------------------------------------
# Relies on: Keras 3's ``Trainer._symbolic_build(data_batch=...)``, which ``fit`` calls
# to create the variables of the compiled loss and metrics from symbolic inputs, so
# that none is created inside the traced step.
# If gone: the compiled loss and metrics are built by evaluating them once, eagerly, on
# a batch of zeros of the dataset's shapes, after which the metrics are reset.
# Relies on, to skip a build that would create no variable (the symbolic build runs the
# model's forward pass once more, a tenth of a small model's first call): the private
# ``model._compile_metrics`` and ``model._compile_loss`` (Keras' ``CompileMetrics`` and
# ``CompileLoss``, with ``.built``), and ``CompileLoss.build`` creating a ``Mean`` tracker
# per loss only when there are several.
# If gone: the symbolic build runs (the same variables, a little slower).


def _builds_no_variable(model) -> bool:
    """Whether building ``model``'s compiled state would create no variable: every layer
    built, the compiled metrics absent or built, and the compiled loss built or for one
    output (its per-output trackers exist only for several)."""
    if not hasattr(model, "_compile_metrics") or not hasattr(model, "_compile_loss"):
        return False
    if not all(layer.built for layer in all_layers(model)):
        return False
    metrics = model._compile_metrics
    if metrics is not None and not metrics.built:
        return False
    loss = model._compile_loss
    if loss is None or loss.built:
        return True
    try:
        outputs = model.outputs  # a functional or Sequential model's (a subclassed one has none)
    except (AttributeError, ValueError):
        return False
    return isinstance(outputs, (list, tuple)) and len(outputs) == 1


@hook('test_keras_defines_its_train_step_in_its_own_modules_and_fit_builds_an_own_step_model_in_it')
def own_step_unbuilt(model) -> bool:
    """Whether ``model`` has its own ``train_step`` and a layer not built yet.

    Its ``call()`` may take other inputs than the data (a GAN's generator takes noise, a
    diffusion model takes noisy images and timesteps): building it by calling it on the
    data would build its layers for the wrong shapes, or fail. ``fit`` without a
    strategy builds nothing before the first step; the step builds what it uses.
    """
    own = next((vars(k)["train_step"] for k in type(model).__mro__ if "train_step" in vars(k)), None)
    keras_step = next((vars(k)["train_step"] for k in type(model).__mro__
                       if k.__module__.startswith("keras.") and "train_step" in vars(k)), None)
    return own is not keras_step and not all(layer.built for layer in all_layers(model))


@hook('test_keras_builds_compiled_metrics_from_an_element_spec')
def build_compiled_state(model, element_spec) -> None:
    """Create the variables of ``model``'s compiled loss and metrics for batches like ``element_spec``."""
    if own_step_unbuilt(model):
        return  # fit calls no model before its first train_step: that step builds what it uses
    build = getattr(model, "_symbolic_build", None)
    if build is not None:
        if not _builds_no_variable(model):
            build(data_batch=element_spec)
        return
    warn_once("_symbolic_build", "keras models have no _symbolic_build: compiled metrics are built on a zero batch")
    batch = tf.nest.map_structure(
        lambda s: tf.zeros([1 if d is None else d for d in s.shape], s.dtype), element_spec
    )
    x, y, weights = (tuple(batch) + (None,))[:3]
    y_pred = model(x, training=False)
    model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=weights)
    model.compute_metrics(x, y, y_pred, sample_weight=weights)
    model.reset_metrics()


# --------------------------------------------------------------------------------------
# The arguments of the running ``model.fit`` (companion.diagnostics.NaNDoctor)
# --------------------------------------------------------------------------------------
# Relies on: Keras 3's ``Trainer.fit(self, x, y, batch_size, ..., sample_weight, ...)``
# being on the stack, with those local names, when it calls a callback's batch hooks.
# If gone: the NaNDoctor callback needs its ``data`` argument (it says so).


@hook('test_keras_fit_is_on_the_stack_of_a_callback_with_its_arguments')
def running_fit_arguments(frame) -> dict[str, Any] | None:
    """``x``, ``y``, ``sample_weight`` and ``batch_size`` of the ``fit`` call on the stack."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "fit" and "keras" in code.co_filename:
            local = frame.f_locals
            if "x" in local and "self" in local:
                return {name: local.get(name) for name in ("x", "y", "sample_weight", "batch_size")}
        frame = frame.f_back
    warn_once("fit frame", "keras' fit is not on the stack with its arguments: pass NaNDoctor(data=...)")
    return None


@hook('test_keras_fit_is_on_the_stack_of_a_callback_with_its_arguments')
def running_fit_locals(frame, names: tuple[str, ...]) -> dict[str, Any] | None:
    """The local variables ``names`` of the ``fit`` call on the stack (``None`` if not found)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "fit" and "keras" in code.co_filename and "self" in frame.f_locals:
            local = frame.f_locals
            return {name: local.get(name) for name in names}
        frame = frame.f_back
    return None


# --------------------------------------------------------------------------------------
# 8c. The batches the running ``fit`` trains on (companion.diagnostics.NaNDoctor)
# --------------------------------------------------------------------------------------
# Relies on: Keras 3's ``fit`` holding its ``TFEpochIterator`` in the local
# ``epoch_iterator`` when it calls ``on_train_begin``, and that iterator taking each
# epoch's batches from its ``_distributed_dataset`` attribute (a ``tf.data.Dataset``
# under the default strategy), which Keras builds before ``on_train_begin`` (for
# arrays with ``shuffle=True``, the rows are permuted there, per epoch, by
# ``tf.random.shuffle``: nothing outside the pipeline knows the permutation).
# The tap maps the dataset through an op that puts each batch, in the order the
# pipeline yields it (the order ``fit`` trains on), into a queue the doctor reads.
# If gone: no tap (a warning says so), and the doctor diagnoses the rows of the
# unshuffled arrays in fit's order, saying that fit shuffled them.


@hook('test_keras_fit_shuffled_batches_can_be_tapped_in_the_order_fit_trains_on_them')
def tap_fit_batches(frame, record: Callable[[Any], None]) -> "BatchTap | None":
    """Make the running ``fit`` hand each batch it trains on to ``record``, in order.

    Returns the :class:`BatchTap` (call it to remove the tap), or ``None`` if it cannot
    be installed.
    """
    found = running_fit_locals(frame, ("epoch_iterator",))
    iterator = None if found is None else found["epoch_iterator"]
    dataset = getattr(iterator, "_distributed_dataset", None)
    if isinstance(dataset, tf.distribute.DistributedDataset):
        return None  # under a distribution strategy each replica has its own part: not tapped
    if not isinstance(dataset, tf.data.Dataset):
        warn_once("epoch_iterator", "keras' fit has no epoch_iterator with a tf.data.Dataset: the NaN doctor "
                                    "cannot see the batches fit shuffled")
        return None
    return BatchTap(iterator, dataset, record)


class BatchTap:
    """The tap of a running ``fit``'s batches (see :func:`tap_fit_batches`).

    Each batch the pipeline yields is put, as the pipeline yields it, into a queue of
    tensors (no Python runs in tf.data's thread: a ``tf.py_function`` there cost a step
    of a small model some 0.3 ms of CPU); :meth:`collect` hands the queued batches to
    ``record``, in order, and :meth:`discard` drops them. A batch of composite tensors
    (ragged, sparse), which a queue cannot hold, is handed on by a ``tf.py_function``.
    Calling the tap drops what is left and removes it.
    """

    def __init__(self, iterator, dataset: tf.data.Dataset, record: Callable[[Any], None]) -> None:
        self._iterator, self._dataset, self._record = iterator, dataset, record
        spec = dataset.element_spec
        self._structure = tuple(spec) if isinstance(spec, tuple) else spec
        flat = tf.nest.flatten(spec)
        self._queue = None
        if all(type(s) is tf.TensorSpec for s in flat):  # noqa: E721 - not a subclass's composite
            with tf.init_scope():
                self._queue = tf.queue.FIFOQueue(-1, [s.dtype for s in flat], shapes=None)
        as_tuple = isinstance(spec, tuple)  # map hands a tuple's items as arguments
        queue = self._queue

        def tap(*element):
            structure = tuple(element) if as_tuple else element[0]
            values = tf.nest.flatten(structure)
            if queue is not None:
                done = queue.enqueue(values)
            else:
                def hand_on(*values):
                    record(tf.nest.pack_sequence_as(structure, [v.numpy() for v in values]))
                    return 0

                done = tf.py_function(hand_on, values, tf.int32)
            with tf.control_dependencies([done]):
                return tf.nest.map_structure(tf.identity, structure)

        with warnings.catch_warnings():  # "run_functions_eagerly does not apply to tf.data functions": known
            warnings.simplefilter("ignore", UserWarning)
            iterator._distributed_dataset = dataset.map(tap).prefetch(tf.data.AUTOTUNE)

    def collect(self) -> None:
        """Hand the batches queued so far to ``record``, in the order fit trains on them."""
        self._take(self._record)

    def discard(self) -> None:
        """Drop the batches queued so far."""
        self._take(None)

    def _take(self, record) -> None:
        queue = self._queue
        if queue is None:
            return
        for _ in range(int(queue.size())):
            values = queue.dequeue()
            if record is not None:
                record(tf.nest.pack_sequence_as(self._structure, [v.numpy() for v in tf.nest.flatten(values)]))

    def __call__(self) -> None:
        """Drop what is left and remove the tap."""
        self.discard()
        self._iterator._distributed_dataset = self._dataset


# --------------------------------------------------------------------------------------
# Keras' fit under MultiWorkerMirroredStrategy (companion.training.step)
# --------------------------------------------------------------------------------------
# Relies on: Keras 3's ``TensorFlowTrainer._maybe_symbolic_build(iterator, data_batch)``,
# called by ``fit``/``evaluate`` before the first step, and ``Trainer._symbolic_build``;
# the epoch iterator it gets yields ``(begin, end, iterator)`` (Keras 3.15) or has
# ``enumerate_epoch()`` of ``(step, iterator)`` (Keras 3.5).
# Keras 3.15 takes the example batch of a distributed dataset by
# ``strategy.reduce("MEAN", batch, axis=None)``, which fails under
# ``MultiWorkerMirroredStrategy`` (``ValueError: Attempt to convert a value (PerReplica
# ...)``); the repair takes the local replica's part of the batch (only its shapes
# and dtypes are used) and builds from it, as Keras does for one worker.
# If gone: no repair is installed (a warning says so), and ``fit`` fails as Keras' does.


@hook('test_the_first_batch_of_either_keras_epoch_iterator_is_found', 'tests/distributed/test_training_multiworker.py::test_every_worker_ends_with_identical_weights_and_history')
def repair_symbolic_build_for_multi_worker(model) -> None:
    """Make ``model``'s symbolic build take its example batch from the local replica."""
    original = getattr(type(model), "_maybe_symbolic_build", None)
    if original is None or not callable(getattr(model, "_symbolic_build", None)):
        warn_once(
            "_maybe_symbolic_build",
            "keras models have no _maybe_symbolic_build/_symbolic_build: fit under MultiWorkerMirroredStrategy "
            "is not repaired",
        )
        return

    def local_symbolic_build(iterator=None, data_batch=None):
        strategy = model.distribute_strategy
        batch = _first_batch(iterator) if iterator is not None else None
        if batch is not None:
            data_batch = tf.nest.map_structure(
                lambda v: strategy.experimental_local_results(v)[0]
                if isinstance(v, tf.distribute.DistributedValues)
                else v,
                batch,
            )
        with strategy.scope():
            model._symbolic_build(data_batch=data_batch)

    model._maybe_symbolic_build = local_symbolic_build


def _first_batch(epoch_iterator):
    """The first batch of a Keras epoch iterator, as ``_maybe_symbolic_build`` takes it.

    Keras 3.15 iterates it as ``(begin, end, iterator)``; Keras 3.5 has only
    ``enumerate_epoch()``, of ``(step, iterator)``: the iterator is the last item of
    either.
    """
    if hasattr(type(epoch_iterator), "__iter__"):
        steps = iter(epoch_iterator)
    else:
        steps = epoch_iterator.enumerate_epoch()
    for item in steps:
        return next(item[-1])
    return None


@hook('test_keras_fit_s_symbolic_build_repair_is_installed_and_undone_on_the_instance')
def undo_symbolic_build_repair(model) -> None:
    """Remove what :func:`repair_symbolic_build_for_multi_worker` installed."""
    vars(model).pop("_maybe_symbolic_build", None)


# --------------------------------------------------------------------------------------
# Which callback methods are Keras' empty defaults (companion.training.loop)
# --------------------------------------------------------------------------------------
# Relies on: Keras 3 marking the empty methods of ``keras.callbacks.Callback`` with
# ``_is_default = True`` (``keras.src.utils.python_utils.default``), which is how its own
# ``CallbackList`` decides whether batch hooks need calling (``LambdaCallback`` sets its
# hooks on the instance, so comparing with the class's method is not enough).
# If gone: a method counts as default when it is the base class's own function.


@hook('test_keras_marks_the_empty_callback_methods_as_defaults')
def is_default_callback_method(callback, name: str) -> bool:
    """Whether ``callback.<name>`` is Keras' empty default (not a hook the user gave)."""
    import keras

    method = getattr(callback, name, None)
    if method is None:
        return True
    base = getattr(keras.callbacks.Callback, name, None)
    if base is not None and not hasattr(base, "_is_default"):
        warn_once("_is_default", "keras.callbacks.Callback methods carry no _is_default mark")
        return getattr(method, "__func__", method) is base
    return bool(getattr(method, "_is_default", False))


# --------------------------------------------------------------------------------------
# A host call with fewer batches than steps_per_execution (companion.training.loop)
# --------------------------------------------------------------------------------------
# Relies on: the source of ``keras.src.backend.tensorflow.trainer`` (Keras' TensorFlow
# trainer; ``_make_function`` in newer Keras, ``make_train_function`` in 3.5), whose
# multi-step loop reads its batches with ``iterator.get_next_as_optional()`` in
# newer Keras (3.13 and 3.15 do), so that an epoch or a validation pass shorter than
# ``steps_per_execution`` ends with a shorter last call. Older Keras (3.5) reads them
# with ``get_next()``: the short last call raises OutOfRangeError, which ``fit`` takes
# for the end of the data, and the validation pass (or the last steps) is lost.
# If gone: ``False`` (a warning says so), and train chooses several steps per host call
# only where every call is full (no validation, an epoch of at most 1024 batches).


@hook('test_keras_multi_step_loop_says_whether_it_ends_short_calls')
def multi_step_loop_ends_short_calls() -> bool:
    """Whether Keras' multi-step loop runs a last host call shorter than ``steps_per_execution``."""
    import inspect

    try:
        from keras.src.backend.tensorflow import trainer

        source = inspect.getsource(trainer)
    except (ImportError, AttributeError, OSError, TypeError):
        warn_once(
            "keras_tf_trainer_source",
            "the source of keras.src.backend.tensorflow.trainer is not readable: train runs several steps per "
            "host call only where every call is full",
        )
        return False
    return "get_next_as_optional" in source and "multi_step_on_iterator" in source


# --------------------------------------------------------------------------------------
# The compiled step functions fit and evaluate keep on the model
# --------------------------------------------------------------------------------------
# Relies on: Keras 3's ``Trainer.fit`` calling ``make_train_function()``, which keeps the
# function it compiles in ``model.train_function`` and reuses what it finds there (a new
# one only when it is ``None``); the same for ``evaluate`` (and ``fit``'s validation)
# with ``make_test_function`` and ``model.test_function``. The attributes are public but
# undocumented, so they are a hook like the private names: ``train`` installs its guarded
# function there for the duration of the call and puts the user's back afterwards
# (companion.training.patches), so that a later plain ``model.fit`` runs Keras' own step.
# If renamed: a warning says so; the guarded step is still what fit traces (train also
# replaces ``model.train_step``), but a function fit cached under the new name could
# outlive the call: the canary fails first.

#: The model attributes where fit and evaluate keep their compiled step functions.
STEP_FUNCTION_ATTRIBUTES = ("train_function", "test_function")


@hook("test_keras_fit_and_evaluate_keep_and_reuse_their_step_functions_on_the_model")
def step_function_attributes(model) -> tuple[str, ...]:
    """The attributes of ``model`` that hold its compiled ``fit``/``evaluate`` step functions."""
    missing = [name for name in STEP_FUNCTION_ATTRIBUTES if not hasattr(model, name)]
    if missing:
        warn_once(
            "train_function",
            f"keras models have no {', '.join(missing)}: train cannot put the user's compiled step functions back",
        )
        return tuple(name for name in STEP_FUNCTION_ATTRIBUTES if name not in missing)
    return STEP_FUNCTION_ATTRIBUTES
