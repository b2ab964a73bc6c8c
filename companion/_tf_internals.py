"""Every use of a private TensorFlow or Keras API in :mod:`companion`, in one place.

No other module of the package names a private TensorFlow/Keras module, attribute or
error text. Each hook below says

* what it relies on (the private name, and the TensorFlow/Keras behaviour behind it),
* what happens when it is gone: the caller falls back to a public, slower or less
  informative way, and :func:`warn_once` issues an :class:`InternalAPIWarning` the first
  time (never a silent fall-back),

and has a canary test in ``tests/contracts/test_tf_internals.py`` that fails loudly when an
upgrade of TensorFlow or Keras removes the hook or stops calling it.
"""

from __future__ import annotations

import contextlib
import re
import threading
import warnings
from typing import Any, Callable, Iterator

import tensorflow as tf


class InternalAPIWarning(RuntimeWarning):
    """A private TensorFlow/Keras API that :mod:`companion` relies on is gone or changed.

    The package still works, through a fall-back that the warning names; report it so
    the hook can be updated.
    """


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str) -> None:
    """Issue ``message`` as an :class:`InternalAPIWarning`, once per process and ``key``."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, InternalAPIWarning, stacklevel=3)


# --------------------------------------------------------------------------------------
# 1. Variable writes while tracing (the masked update of companion.training)
# --------------------------------------------------------------------------------------
# Relies on: every resource-variable write (``Variable.assign``, ``assign_add``,
# ``assign_sub``, so every write of a Keras optimizer's ``apply``) calling
# ``tensorflow.python.ops.gen_resource_variable_ops.assign_variable_op`` (and the _add /
# _sub variants) through the module attribute, at trace time.
# If gone: ``variable_writes_interceptable()`` is False (or the traced update holds
# writes that did not come through the interceptor), and the training loop puts the
# update under a ``tf.cond`` instead: the same results, slower under XLA.
# The patch is installed while at least one thread traces under it (reference count,
# under a lock) and only rewrites writes of the threads that asked for it, so two
# threads tracing at once can neither leave it installed nor see each other's rewrite.

_WRITERS = {
    "assign_variable_op": lambda old, value: value,
    "assign_add_variable_op": lambda old, value: old + value,
    "assign_sub_variable_op": lambda old, value: old - value,
}
_patch_lock = threading.Lock()
_patch_users = 0
_patch_originals: dict[str, Callable] = {}
_thread_rewriters = threading.local()


def _resource_variable_ops():
    try:
        from tensorflow.python.ops import gen_resource_variable_ops as module
    except ImportError:  # pragma: no cover - depends on the TensorFlow version
        return None
    if not all(callable(getattr(module, name, None)) for name in (*_WRITERS, "read_variable_op")):
        return None  # pragma: no cover
    return module


def variable_writes_interceptable() -> bool:
    """Whether :func:`intercept_variable_writes` can work with this TensorFlow."""
    if _resource_variable_ops() is None:  # pragma: no cover - depends on the TensorFlow version
        warn_once(
            "gen_resource_variable_ops",
            "tensorflow.python.ops.gen_resource_variable_ops has no assign_variable_op: the masked update is "
            "unavailable, so companion.training puts the update under a tf.cond (same results, slower with XLA)",
        )
        return False
    return True


def _patched(name: str, original: Callable, assign: Callable, read: Callable) -> Callable:
    combine = _WRITERS[name]

    def write(resource, value, *args, **kwargs):
        rewriters = getattr(_thread_rewriters, "stack", None)
        if not rewriters:
            return original(resource, value, *args, **kwargs)
        old = read(resource, value.dtype)
        return assign(resource, rewriters[-1](old, combine(old, value)), *args, **kwargs)

    write.__wrapped__ = original
    return write


@contextlib.contextmanager
def intercept_variable_writes(rewrite: Callable[[tf.Tensor, tf.Tensor], tf.Tensor]) -> Iterator[None]:
    """While active in this thread, every traced variable write assigns ``rewrite(old, new)``.

    ``old`` is the variable's value read right before the write and ``new`` the value the
    original write would store (``old + delta`` for ``assign_add``). Writes of other
    threads are not touched. Call :func:`variable_writes_interceptable` first.
    """
    global _patch_users
    module = _resource_variable_ops()
    if module is None:  # pragma: no cover - depends on the TensorFlow version
        raise RuntimeError("variable writes cannot be intercepted with this TensorFlow")
    with _patch_lock:
        if _patch_users == 0:
            _patch_originals.update({name: getattr(module, name) for name in _WRITERS})
            assign, read = _patch_originals["assign_variable_op"], module.read_variable_op
            for name, original in _patch_originals.items():
                setattr(module, name, _patched(name, original, assign, read))
        _patch_users += 1
    stack = _thread_rewriters.__dict__.setdefault("stack", [])
    stack.append(rewrite)
    try:
        yield
    finally:
        stack.pop()
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                for name, original in _patch_originals.items():
                    setattr(module, name, original)
                _patch_originals.clear()


def variable_writes_patched() -> bool:
    """Whether the write interceptor is installed right now (for tests)."""
    module = _resource_variable_ops()
    return module is not None and any(hasattr(getattr(module, name), "__wrapped__") for name in _WRITERS)


# --------------------------------------------------------------------------------------
# 2. The variables a Keras optimizer was built for
# --------------------------------------------------------------------------------------
# Relies on: Keras 3's ``BaseOptimizer._trainable_variables``, the list given to
# ``build``. Used to refuse, before any step, an optimizer built for another model.
# If gone: the check is skipped (a mismatch then fails inside the first step, with
# Keras' own error).


def optimizer_variables_known(optimizer, variables) -> bool:
    """Whether ``optimizer`` was built for every variable of ``variables``."""
    known = getattr(optimizer, "_trainable_variables", None)
    if known is None:
        warn_once(
            "optimizer._trainable_variables",
            "keras optimizers have no _trainable_variables: train() cannot check before the first step that the "
            "optimizer was built for this model",
        )
        return True
    ids = {id(v) for v in known}
    return all(id(v) in ids for v in variables)


# --------------------------------------------------------------------------------------
# 3. Gradients already summed over replicas
# --------------------------------------------------------------------------------------
# Relies on: Keras 3's TensorFlow optimizer all-reducing the gradients inside ``apply``
# through its method ``_all_reduce_sum_gradients(grads_and_vars)``. The training loop
# has summed them for the finiteness test already; overriding the method on the
# instance with the identity avoids a second all-reduce.
# If gone: each replica hands the optimizer its own share (scaled by 1/global batch)
# and the optimizer's all-reduce sums them: the same numbers, twice the traffic.


def can_skip_optimizer_all_reduce(optimizer) -> bool:
    """Whether :func:`optimizer_all_reduce_skipped` works for ``optimizer``."""
    if callable(getattr(type(optimizer), "_all_reduce_sum_gradients", None)):
        return True
    warn_once(
        "_all_reduce_sum_gradients",
        f"{type(optimizer).__name__} has no _all_reduce_sum_gradients: with several replicas the gradients are "
        "all-reduced twice per step (once for the finiteness test, once by the optimizer)",
    )
    return False


_skip_lock = threading.Lock()
_skip_users: dict[int, int] = {}


@contextlib.contextmanager
def optimizer_all_reduce_skipped(optimizer) -> Iterator[None]:
    """While tracing ``optimizer.apply``: tell it its gradients are summed already.

    Reference-counted per optimizer: under ``MirroredStrategy`` every replica's thread
    enters it around the same ``merge_call``.
    """
    with _skip_lock:
        count = _skip_users.get(id(optimizer), 0)
        if count == 0:
            optimizer._all_reduce_sum_gradients = list  # the (gradient, variable) pairs, unchanged
        _skip_users[id(optimizer)] = count + 1
    try:
        yield
    finally:
        with _skip_lock:
            _skip_users[id(optimizer)] -= 1
            if _skip_users[id(optimizer)] == 0:
                del _skip_users[id(optimizer)]
                del optimizer._all_reduce_sum_gradients


# --------------------------------------------------------------------------------------
# 4. Every layer of a model
# --------------------------------------------------------------------------------------
# Relies on: Keras 3's ``Layer._flatten_layers(include_self=True, recursive=True)``.
# If gone: a walk over the public ``layers`` attributes (which misses layers kept in
# plain attributes of a subclassed layer).


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
# 4b. Building a compiled model's loss and metric state before the first step
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


def build_compiled_state(model, element_spec) -> None:
    """Create the variables of ``model``'s compiled loss and metrics for batches like ``element_spec``."""
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
# 5. Whether a strategy spans several workers
# --------------------------------------------------------------------------------------
# Relies on: ``strategy.extended._in_multi_worker_mode()`` (TensorFlow's own test for
# "this strategy has a cluster of several tasks").
# If gone: a ``MultiWorkerMirroredStrategy`` whose cluster spec has more than one task.


def in_multi_worker_mode(strategy: tf.distribute.Strategy) -> bool:
    """Whether ``strategy`` runs on several workers (processes)."""
    method = getattr(strategy.extended, "_in_multi_worker_mode", None)
    if method is not None:
        return bool(method())
    warn_once(
        "_in_multi_worker_mode",
        "tf.distribute strategies have no extended._in_multi_worker_mode: multi-worker mode is inferred from "
        "the cluster spec",
    )
    resolver = getattr(strategy, "cluster_resolver", None)
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or resolver is None:
        return False
    spec = resolver.cluster_spec()
    return sum(spec.num_tasks(job) for job in spec.jobs) > 1


# --------------------------------------------------------------------------------------
# 6. Replica-context optimizers without merge_call
# --------------------------------------------------------------------------------------
# Relies on: ``tf.__internal__.distribute.strategy_supports_no_merge_call()``, which
# Keras' own optimizers use to decide between an all-reduce in replica context and a
# ``merge_call``.
# If gone: ``merge_call`` (works under every strategy; a little slower).


def strategy_supports_no_merge_call() -> bool:
    """Whether the current strategy can all-reduce in replica context."""
    internal = getattr(getattr(tf.__internal__, "distribute", None), "strategy_supports_no_merge_call", None)
    if internal is None:  # pragma: no cover - depends on the TensorFlow version
        warn_once(
            "strategy_supports_no_merge_call",
            "tf.__internal__.distribute.strategy_supports_no_merge_call is gone: SkipNonFinite uses merge_call",
        )
        return False
    return bool(internal())


# --------------------------------------------------------------------------------------
# 7. Op callbacks and the check-numerics state (companion.diagnostics)
# --------------------------------------------------------------------------------------
# Relies on: ``tensorflow.python.framework.op_callbacks.add_op_callback`` /
# ``remove_op_callback``: the op-by-op re-run of the diagnostics sees every eager op's
# inputs and outputs through one. TensorFlow hands each callback's return value to the
# next callback as the op's outputs while it builds a graph (a ``dataset.map`` inside
# the traced code), so a callback must return ``outputs``, never ``None``. Also the
# module state ``tensorflow.python.debug.lib.check_numerics_callback._state`` (whether
# the user had ``enable_check_numerics`` on, so it can be paused and restored).
# If gone: no op is seen (a warning says so): diagnoses name the batch and the
# variables but no op; the user's check-numerics setting is assumed off.


@contextlib.contextmanager
def op_callback(callback: Callable) -> Iterator[bool]:
    """Register ``callback`` for every op while active; yields whether that was possible."""
    try:
        from tensorflow.python.framework import op_callbacks
    except ImportError:  # pragma: no cover
        op_callbacks = None
    if op_callbacks is None or not hasattr(op_callbacks, "add_op_callback"):  # pragma: no cover
        warn_once("op_callbacks", "tensorflow op_callbacks are gone: the NaN doctor cannot see ops one by one")
        yield False
        return
    op_callbacks.add_op_callback(callback)
    try:
        yield True
    finally:
        op_callbacks.remove_op_callback(callback)


def check_numerics_enabled() -> bool:
    """Whether :func:`tf.debugging.enable_check_numerics` is on in this thread."""
    try:
        from tensorflow.python.debug.lib import check_numerics_callback
        state = check_numerics_callback._state
    except (ImportError, AttributeError):  # pragma: no cover
        warn_once("check_numerics_callback._state", "cannot tell whether enable_check_numerics is on; assuming off")
        return False
    return hasattr(state, "check_numerics_callback")


# --------------------------------------------------------------------------------------
# 8. The forward op of a gradient being computed (from a traceback or the live stack)
# --------------------------------------------------------------------------------------
# Relies on: eager ``GradientTape.gradient`` calling each op's registered gradient from
# ``tensorflow/python/eager/backprop.py``'s ``_gradient_function(op_name, attr_tuple,
# num_inputs, inputs, outputs, out_grads, skip_input_indices, forward_pass_name_scope)``;
# its local ``op_name`` is the forward op's type and ``inputs``/``outputs`` the forward
# op's tensors (the op-by-op re-run maps them back to the forward op's record).
# Also relies on ``GradientTape.gradient`` (backprop.py) and ``imperative_grad``
# (imperative_grad.py) being Python frames on the stack while the tape runs ops.
# If gone: a gradient op is reported as an op of the forward pass, without the forward
# op it differentiates, its layer and its line (no warning: the stack is only read).


def backprop_forward_op(frame) -> dict[str, Any] | None:
    """The forward op that eager backprop is differentiating, seen from ``frame`` outwards.

    Returns ``None`` outside ``GradientTape.gradient``; else a dict with the forward op's
    ``op_type``, the ``inputs`` and ``outputs`` the tape kept for it (tensors, or
    ``None`` where the gradient does not need them) and its forward ``scope``.
    """
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_gradient_function" and code.co_filename.endswith("backprop.py"):
            local = frame.f_locals
            forward = local.get("op_name")
            return {
                "op_type": forward.decode() if isinstance(forward, bytes) else str(forward),
                "inputs": tuple(local.get("inputs") or ()),
                "outputs": tuple(local.get("outputs") or ()),
                "scope": local.get("forward_pass_name_scope"),
            }
        frame = frame.f_back
    return None


def in_backprop(frame) -> bool:
    """Whether ``frame`` (or a caller) runs inside eager ``GradientTape.gradient``."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "imperative_grad" and code.co_filename.endswith("imperative_grad.py"):
            return True
        if code.co_name == "gradient" and code.co_filename.endswith("backprop.py"):
            return True
        frame = frame.f_back
    return False


# --------------------------------------------------------------------------------------
# 8b. The arguments of the running ``model.fit`` (companion.diagnostics.NaNDoctor)
# --------------------------------------------------------------------------------------
# Relies on: Keras 3's ``Trainer.fit(self, x, y, batch_size, ..., sample_weight, ...)``
# being on the stack, with those local names, when it calls a callback's batch hooks.
# If gone: the NaNDoctor callback needs its ``data`` argument (it says so).


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
# The tap maps the dataset through a ``tf.py_function`` that hands each batch, in the
# order the pipeline yields it (the order ``fit`` trains on), to a Python function.
# If gone: no tap (a warning says so), and the doctor diagnoses the rows of the
# unshuffled arrays in fit's order, saying that fit shuffled them.


def tap_fit_batches(frame, record: Callable[[Any], None]) -> Callable[[], None] | None:
    """Make the running ``fit`` hand each batch it trains on to ``record``, in order.

    Returns a function that removes the tap, or ``None`` if it cannot be installed.
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

    as_tuple = isinstance(dataset.element_spec, tuple)  # map hands a tuple's items as arguments

    def tap(*element):
        structure = tuple(element) if as_tuple else element[0]
        flat = tf.nest.flatten(structure)

        def hand_on(*values):
            record(tf.nest.pack_sequence_as(structure, [v.numpy() for v in values]))
            return 0

        done = tf.py_function(hand_on, flat, tf.int32)
        with tf.control_dependencies([done]):
            return tf.nest.map_structure(tf.identity, structure)

    with warnings.catch_warnings():  # "run_functions_eagerly does not apply to tf.data functions": known
        warnings.simplefilter("ignore", UserWarning)
        iterator._distributed_dataset = dataset.map(tap).prefetch(tf.data.AUTOTUNE)

    def remove() -> None:
        iterator._distributed_dataset = dataset

    return remove


# --------------------------------------------------------------------------------------
# 9. TensorFlow's error texts
# --------------------------------------------------------------------------------------
# Relies on: the wording of TensorFlow's messages for (a) an XLA compilation failure,
# (b) an aborted collective. They are not an API.
# If gone: (a) an XLA failure is raised instead of retried without XLA; (b) the
# WorkerLostError message quotes the first line of TensorFlow's error. Each canary
# test provokes the real error.

_XLA_MARKERS = ("_XlaMustCompile", "XLA_CPU_JIT", "XLA_GPU_JIT", "XLA_TPU_JIT", "could not be compiled", "XlaCompile")


def looks_like_xla_failure(error: Exception) -> bool:
    """Whether ``error`` says that XLA could not compile a function."""
    return any(marker in str(error) for marker in _XLA_MARKERS)


def xla_failure_summary(error: Exception) -> str:
    """One line saying why XLA failed, e.g. ``"no XLA kernel for EagerPyFunc"``."""
    text = str(error)
    unsupported = re.search(r"on XLA_\w+_JIT: ([\w, ]+)", text)
    if unsupported:
        return f"no XLA kernel for {unsupported.group(1).strip()}"
    for line in text.splitlines():
        if "XLA" in line or "compile" in line:
            return line.strip()[:300]
    return text.strip().splitlines()[0][:300] if text.strip() else type(error).__name__


def collective_error_summary(text: str) -> str:
    """The line of a failed collective's error message that says what happened."""
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", text)
    aborted = re.search(r"Collective ops is aborted by: (.+)", text)
    if aborted:
        return aborted.group(1).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if re.search(r"unhealthy|timed out|reset by peer|refused|Socket closed|is down|unavailable", line, re.I):
            return line
    return lines[0] if lines else ""


def tasks_named_in(text: str) -> tuple[str, ...]:
    """The ``/job:…/replica:…/task:…`` names in an error message, in order, once each."""
    return tuple(dict.fromkeys(re.findall(r"/job:\w+/replica:\d+/task:\d+", text)))


# --------------------------------------------------------------------------------------
# 10. A variable's initial value that restores a checkpoint (the ulp perturbation)
# --------------------------------------------------------------------------------------
# Relies on: ``tf.train.Checkpoint`` restoring a variable that is created after
# ``restore()`` was called ("restore on create") by passing a
# ``tensorflow.python.trackable.base.CheckpointInitialValueCallable`` as the
# ``initial_value`` of the new variable, through every variable creator.
# Why: ``companion.book.notebook.setup(perturb_ulp=True)`` moves every new variable's initial
# value by one ulp; a value read from a checkpoint must come back bit for bit, as it would
# through an ``assign``.
# If gone: ``is_checkpoint_restore`` recognises the value by its ``checkpoint_position``
# attribute (public on that class); if that is gone too, a restored-on-create variable is
# perturbed like any other (a resumed run then differs by one ulp under the switch only).


def is_checkpoint_restore(initial_value: Any) -> bool:
    """Whether a variable creator's ``initial_value`` is a value restored from a checkpoint."""
    try:
        from tensorflow.python.trackable.base import CheckpointInitialValue, CheckpointInitialValueCallable
    except ImportError:  # pragma: no cover - depends on the TensorFlow version
        warn_once("CheckpointInitialValueCallable", "tensorflow's restore-on-create value class is gone: "
                  "recognising restored values by their checkpoint_position attribute")
        return getattr(initial_value, "checkpoint_position", None) is not None
    return isinstance(initial_value, (CheckpointInitialValue, CheckpointInitialValueCallable))


# --------------------------------------------------------------------------------------
# 11. The global random-number states (the NaN doctor's re-run changes nothing)
# --------------------------------------------------------------------------------------
# Relies on: Keras 3 keeping the ``SeedGenerator`` that random ops without a seed draw
# from (``keras.random.normal(shape)``, a layer that calls ``keras.random.dropout``
# without one) as the global attribute ``"global_seed_generator"`` of
# ``keras.src.backend.common.global_state``, its state in ``.state``; and TensorFlow
# keeping its global ``tf.random.Generator`` in ``stateful_random_ops.global_generator``
# (``None`` until ``tf.random.get_global_generator()`` first creates it).
# Why: the doctor's re-run of a batch must not advance them, or the steps after a
# diagnosed skip draw other random numbers than a run without the doctor.
# If gone: those states are not restored (a re-run of a model that draws unseeded
# random numbers then moves them on), with a warning.


def global_random_states() -> list:
    """The state variables of Keras' and TensorFlow's global random generators that exist now."""
    states = []
    try:
        from keras.src.backend.common import global_state
    except ImportError:  # pragma: no cover - depends on the Keras version
        warn_once("global_seed_generator", "keras' global_state module is gone: the global SeedGenerator's state "
                  "is not restored after the NaN doctor's re-run")
    else:
        generator = global_state.get_global_attribute("global_seed_generator")
        if generator is not None and getattr(generator, "state", None) is not None:
            states.append(generator.state)
    try:
        from tensorflow.python.ops import stateful_random_ops
    except ImportError:  # pragma: no cover - depends on the TensorFlow version
        warn_once("global_generator", "tensorflow's stateful_random_ops is gone: the global tf.random.Generator "
                  "is not restored after the NaN doctor's re-run")
    else:
        generator = getattr(stateful_random_ops, "global_generator", None)
        if generator is not None:
            states.append(generator.state)
    return states


# --------------------------------------------------------------------------------------
# 12. Keras' fit under MultiWorkerMirroredStrategy (companion.training.guard)
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


def undo_symbolic_build_repair(model) -> None:
    """Remove what :func:`repair_symbolic_build_for_multi_worker` installed."""
    vars(model).pop("_maybe_symbolic_build", None)


# --------------------------------------------------------------------------------------
# 13. Which callback methods are Keras' empty defaults (companion.training.loop)
# --------------------------------------------------------------------------------------
# Relies on: Keras 3 marking the empty methods of ``keras.callbacks.Callback`` with
# ``_is_default = True`` (``keras.src.utils.python_utils.default``), which is how its own
# ``CallbackList`` decides whether batch hooks need calling (``LambdaCallback`` sets its
# hooks on the instance, so comparing with the class's method is not enough).
# If gone: a method counts as default when it is the base class's own function.


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
# 14. Two MirroredStrategys in one process (companion.training.guard)
# --------------------------------------------------------------------------------------
# Relies on: ``MirroredStrategy.extended._collective_keys``, a
# ``tensorflow.python.distribute.cross_device_utils.CollectiveKeys`` whose instance keys
# start at the same number (``_instance_key_table[group][device]``) in every strategy,
# with the same group key (1). TensorFlow's runtime caches a collective's parameters by
# (group key, instance key), so a second strategy in the same process reuses the keys of
# the first with other shapes and aborts ("Shape mismatch in the collective instance
# 100"), with fit as with train. Each strategy train runs under gets instance keys of
# its own range.
# If gone: nothing is changed (a warning says so); two strategies in one process then
# abort as they do with fit.

_INSTANCE_KEY_STRIDE = 1_000_000
_collective_ranges = [0]
_collective_lock = threading.Lock()


def isolate_collective_keys(strategy) -> None:
    """Give a single-worker ``strategy`` collective instance keys unused in this process."""
    keys = getattr(strategy.extended, "_collective_keys", None)
    table = getattr(keys, "_instance_key_table", None)
    if not isinstance(table, dict):
        warn_once(
            "_collective_keys",
            "MirroredStrategy has no _collective_keys._instance_key_table: two strategies in one process may "
            "abort with a collective shape mismatch",
        )
        return
    with _collective_lock:
        if getattr(keys, "_companion_isolated", False):
            return
        # (A strategy used already just continues in the new range: its keys only grow.)
        _collective_ranges[0] += 1
        offset = _collective_ranges[0] * _INSTANCE_KEY_STRIDE
        for group in table.values():
            for device in group:
                group[device] += offset
        keys._companion_isolated = True


# --------------------------------------------------------------------------------------
# 15. A host call with fewer batches than steps_per_execution (companion.training.loop)
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
