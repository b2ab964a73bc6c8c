"""The NaN doctor: :func:`diagnose` and the :class:`Diagnosis` it returns.

:func:`diagnose` takes a model and data as ``fit`` does and:

1. runs each batch through the loss and its gradients as ``fit``'s compiled step
   computes them (XLA if the model was compiled with it), updating nothing but the
   random states (batch k draws its dropout masks, noise and timesteps from the states
   ``fit`` had at step k; they are put back at the end), until one has a non-finite
   loss or gradient;
2. checks that batch's inputs, targets and sample weights (for a ``tf.data`` pipeline,
   the map function that made a NaN, its op and line), then the model's weights;
3. re-runs the batch op by op (:class:`~companion.diagnostics.trace.OpTracer`): the
   first forward op whose output is not finite if the loss is not, else the first op
   of the backward pass, mapped to the forward op it differentiates;
4. names the cause (one of ``CAUSES``) from that op and its
   inputs, and says whether the compiled step and the op-by-op re-run disagree;
5. where every batch's loss and gradients are finite, checks what the update would
   write (``companion.diagnostics.update``: the optimizer applied to copies, and
   the moving statistics the training forward pass writes): a variable the update
   makes non-finite is ``nonfinite_update``, with the optimizer or layer, the line
   that made it and the arithmetic that failed.
"""


from __future__ import annotations

from typing import Any, Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from companion._gradients import gradient_values
from companion.diagnostics.causes import CAUSES, grew
from companion.diagnostics.data import Replay, nonfinite_data
from companion.diagnostics.diagnosis import Diagnosis, from_event, keep_state, replace, symptom
from companion.diagnostics.gradients import _variable_path
from companion.diagnostics.initial import before_any_step, describe, nonfinite_variables
from companion.diagnostics.locate import dtype_name
from companion.diagnostics.pipeline import locate as locate_in_pipeline
from companion.diagnostics.remedies import verify
from companion.diagnostics.scan import loss_function, model_state, random_states, scan
from companion.diagnostics.sources import source_text
from companion.diagnostics.state import restore, snapshot
from companion.diagnostics.step import culprit, pack, step_variables, uses_own_step, written_variables
from companion.diagnostics.step import logs_values as _logs_values
from companion.diagnostics.trace import OpTracer, eager_trace, nonfinite_mask, raised
from companion.diagnostics.update import find_update, own_step_update

__all__ = ["Diagnosis", "diagnose"]


def diagnose(
    model: keras.Model,
    data: Any,
    loss: Callable | str | None = None,
    *,
    y: Any = None,
    sample_weight: Any = None,
    batch_size: int | None = None,
    max_batches: int | None = None,
    skip_batches: int = 0,
    jit_compile: bool | None = None,
    losses_before: Sequence[float] = (),
    eager_fallback: bool = True,
) -> Diagnosis | None:
    """Find the first batch whose loss or gradients are not finite, and say why.

    A model with its own ``train_step`` (a GAN with two optimizers, a VAE, Keras'
    guide's *customizing fit* model) or without a compiled loss, and no ``loss`` given,
    is scanned by running its own ``train_step`` as ``fit`` does, with every variable it
    may write (the model's, its metrics', every optimizer's, the random generators')
    saved before and restored after each batch; a batch is non-finite when a logged
    value or a variable it writes is; its op-by-op re-run names the first op that made a
    non-finite value (the backward op of the user's loss, not the optimizer's ``Sub``
    that consumes the NaN gradient). Otherwise each batch goes through the loss and its
    gradients as ``fit``'s compiled step computes them (``model.compute_loss``: sample weights, a loss per output,
    regularisation; XLA if the model was compiled with ``jit_compile``), with no update
    and no change to the model's state. At the first non-finite batch the doctor checks
    the batch's inputs, targets and sample weights, then the model's weights, then
    re-runs the batch op by op: the first forward op whose output is not finite (if
    the loss is not), else the first op of the backward pass, reported with the
    forward op it differentiates, its layer and its line. The cause is named from that
    op and the values of its inputs. The failing step is run a second time first: if it
    is finite then, the cause is ``"not_reproducible"`` (non-determinism or hardware)
    rather than an op; and if the op-by-op re-run raises where the compiled step only
    returned NaN (an eager kernel checks what the XLA kernel does not), the error is
    reported in the diagnosis, never raised. For a NaN in the data, the variables are
    those whose gradients (or, for an own ``train_step``, whose new values) it makes
    non-finite.

    Args:
        model: a Keras model, compiled or not (not compiled: with ``loss``, or its own
            ``train_step``).
        data: what ``fit`` takes: a ``tf.data.Dataset`` of ``(x, y[, sample_weight])``
            batches, a :class:`keras.utils.PyDataset`, arrays (``x`` with ``y=``, or an
            ``(x, y[, sample_weight])`` tuple, batched by ``batch_size`` in order), a
            single batch, or any iterable of batches.
        loss: the loss; ``None`` uses the model's compiled loss, or its own
            ``train_step`` if it overrides it or has no compiled loss.
        y: targets, when ``data`` is the inputs.
        sample_weight: sample weights, when ``data`` is the inputs.
        batch_size: for arrays, the batch size (``fit``'s default, 32, if ``None``).
        max_batches: look at most at this many batches.
        skip_batches: start after this many batches (their index still counts).
        jit_compile: compile the scanning step with XLA; ``None`` follows the model
            (``model.jit_compile``; ``False`` for an uncompiled model). If nothing
            non-finite is found with XLA, the batches are scanned again without it.
        losses_before: losses of the steps before (e.g. from ``History``): if they grew
            step after step, an overflow is reported as ``"divergence"``.
        eager_fallback: if no batch is non-finite in the compiled step, scan once more
            with the step run eagerly (op by op, as a custom eager loop runs it): some
            NaNs appear only there, and the diagnosis then says so.

    Returns:
        A :class:`Diagnosis`, or ``None`` if every batch's loss, gradients and update
        are finite. A batch whose loss and gradients are finite but whose update is not
        (an optimizer's ``epsilon`` that is 0 in ``float16``, a second moment or a
        moving statistic beyond ``float16``'s range) is ``"nonfinite_update"``: the
        variable, the optimizer's apply or the layer, the line that made it, and a
        remedy checked on copies of the variables.

    Raises:
        TypeError: if ``model`` is not a Keras model or ``data`` is not data.
        ValueError: if the model has neither a loss (``loss`` or compiled) nor its own
            ``train_step``.

    Example:
        >>> class Root(keras.layers.Layer):
        ...     def build(self, shape):
        ...         self.w = self.add_weight(shape=(), initializer="ones", name="w")
        ...     def call(self, x):
        ...         return tf.sqrt(self.w * x)
        >>> model = keras.Sequential([keras.Input((1,)), Root(name="root")], name="net")
        >>> x = np.array([[4.0], [0.0]], "float32")
        >>> d = diagnose(model, (x, np.ones((2, 1), "float32")), "mse")
        >>> d.phase, d.op, d.forward_op, d.layer, d.cause
        ('backward', 'SqrtGrad', 'Sqrt', 'net/root', 'singular_derivative')
        >>> d.inputs_summary, d.variables
        ('1 of 2 inputs of Sqrt are exactly 0', ('net/root/w',))
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"model must be a Keras model, got {type(model).__name__}")
    own = uses_own_step(model, loss)
    loss_fn = None if own else loss_function(model, loss)
    if jit_compile is None:
        jit_compile = bool(getattr(model, "jit_compile", False)) if getattr(model, "compiled", False) else False
    if hasattr(data, "__next__"):  # an iterator or generator: keep what it yields for the re-scans
        data = Replay(data)
    scanned = (model, data, loss_fn, y, sample_weight, batch_size, max_batches, skip_batches)
    origin = snapshot(random_states(model))  # each scan advances them batch by batch, as fit does
    try:
        return _diagnose(model, data, loss_fn, own, scanned, jit_compile, eager_fallback, losses_before, origin)
    finally:
        restore(origin)  # the random states as diagnose found them: it changes nothing


def _diagnose(model, data, loss_fn, own, scanned, jit_compile, eager_fallback, losses_before, origin):
    """The scans (XLA, graph, eager), each from the random states ``origin``, and the failing batch's diagnosis."""
    found = scan(*scanned, jit_compile)
    fallback = None
    if found is None and jit_compile:
        fallback = "XLA"
        restore(origin)
        found = scan(*scanned, False)
    if found is None and eager_fallback:
        fallback = "graph"
        restore(origin)
        found = scan(*scanned, None)
    if found is None:
        # Finite loss and gradients on every batch: the update itself may write the NaN
        # (optimizer arithmetic in a low precision, a weight beyond its dtype's range).
        restore(origin)
        return find_update(*scanned)
    index, (x, y_true, weights), compiled = found
    state = compiled.pop("state", None)
    result = _diagnose_batch(
        model, loss_fn, index, x, y_true, weights, compiled, jit_compile, fallback, tuple(losses_before)
    )
    if result.cause == "nonfinite_input" and isinstance(data, tf.data.Dataset):
        result = locate_in_pipeline(result, data)  # the map function's op and line, where a map made it
    result = verify(result, model, loss_fn, x, y_true, weights)
    keep_state(result, {"kind": "model", "batch": (x, y_true, weights), "variables": state, "own_step": own,
                        "numpy_random": np.random.get_state()})
    return result



def _input_diagnosis(index, bad, compiled) -> Diagnosis:
    label, array = bad[0]
    mask = nonfinite_mask(array)
    nan = int(np.count_nonzero(np.isnan(array.astype(np.complex128 if np.iscomplexobj(array) else np.float64))))
    rows = np.unique(np.nonzero(mask.reshape(mask.shape[0], -1) if mask.ndim else mask.reshape(1, -1))[0])
    shown = ", ".join(str(r) for r in rows[:5]) + (", ..." if len(rows) > 5 else "")
    summary = (
        f"{int(mask.sum())} of {array.size} entries of {label} are not finite ({nan} NaN); "
        f"row{'s' if len(rows) > 1 else ''} {shown}"
    )
    cause = CAUSES["nonfinite_input"]
    return Diagnosis(
        batch=index, phase="input", op=None, forward_op=None, layer=None, source=None,
        variables=tuple(compiled.get("variables", ())), dtype=dtype_name(array), inputs_summary=summary,
        cause="nonfinite_input", fix=cause.fix, section=cause.section, symptom="non-finite input",
    )


def _weights_diagnosis(model, index, compiled, losses_before) -> Diagnosis | None:
    bad = nonfinite_variables(model)
    if not bad:
        return None
    if not losses_before and before_any_step(model):  # set so before training: no step cures it
        found, summary = describe(model, bad)
        cause = CAUSES["nonfinite_init"]
        return Diagnosis(
            batch=index, phase="weights", op=None, forward_op=None, layer=found.layer,
            source=f"{found.filename}:{found.lineno}" if found.filename else None,
            variables=tuple(_variable_path(v) for v, _ in bad), dtype=dtype_name(bad[0][1]),
            inputs_summary=summary, cause="nonfinite_init", fix=cause.fix, section=cause.section,
            symptom=symptom(compiled), code=source_text(found.filename, found.lineno),
        )
    path, value = _variable_path(bad[0][0]), bad[0][1]
    summary = f"{int(nonfinite_mask(value).sum())} of {value.size} entries of {path} are not finite"
    if len(bad) > 1:
        summary += f" (and {len(bad) - 1} more variable{'s' if len(bad) > 2 else ''})"
    name = "divergence" if grew(losses_before) else "nonfinite_weights"
    cause = CAUSES[name]
    return Diagnosis(
        batch=index, phase="weights", op=None, forward_op=None, layer=None, source=None,
        variables=tuple(compiled.get("variables", ())), dtype=dtype_name(value), inputs_summary=summary,
        cause=name, fix=cause.fix, section=cause.section, symptom=symptom(compiled),
    )


def _not_reproduced(index, compiled) -> Diagnosis:
    cause = CAUSES["not_reproducible"]
    return Diagnosis(
        batch=index, phase="loss" if compiled.get("loss") else "backward", op=None, forward_op=None,
        layer=None, source=None, variables=tuple(compiled.get("variables", ())), dtype=None,
        inputs_summary="the same step, run again on the same batch, weights and seeds, is finite",
        cause="not_reproducible", fix=cause.fix, section=cause.section, symptom=symptom(compiled),
    )


def _rerun_failed(index, compiled, error, bad_variables=()) -> Diagnosis:
    cause = CAUSES["unclassified"]
    first = (str(error).strip().splitlines() or [""])[0][:200]
    return Diagnosis(
        batch=index, phase="loss" if compiled.get("loss") else "backward", op=None, forward_op=None,
        layer=None, source=None, variables=tuple(compiled.get("variables", ()) or bad_variables), dtype=None,
        inputs_summary="no op output of the op-by-op re-run was non-finite before it stopped",
        cause="unclassified", fix=cause.fix, section=cause.section, symptom=symptom(compiled),
        mode_disagreement=(
            f"the compiled step is non-finite; run op by op it raised {type(error).__name__}: {first} "
            "(an eager kernel checks what the compiled kernel does not)"
        ),
    )


def rerun_own(model, x, y_true, weights, tracer) -> tuple[OpTracer, bool, list[str]]:
    """The model's own ``train_step`` op by op: the tracer, whether its logs are finite, the variables it wrote non-finite."""
    tf_filtering = tf.debugging.is_traceback_filtering_enabled()
    keras_filtering = keras.config.is_traceback_filtering_enabled()
    saved = snapshot(step_variables(model))
    written = written_variables(model)
    try:
        tf.debugging.disable_traceback_filtering()
        keras.config.disable_traceback_filtering()
        with eager_trace(tracer):
            tracer.stage = "forward"
            logs = model.train_step(pack(x, y_true, weights))
        values = [v for _, v in _logs_values(logs)]
        logs_finite = all(bool(np.all(np.isfinite(np.asarray(tf.cast(v, tf.float32))))) for v in values)
        bad = [_variable_path(v) for v in written if nonfinite_mask(np.asarray(v.numpy())).any()]
    finally:
        restore(saved)
        if tf_filtering:
            tf.debugging.enable_traceback_filtering()
        if keras_filtering:
            keras.config.enable_traceback_filtering()
    return tracer, logs_finite, bad


def rerun(model, loss_fn, x, y_true, weights, tracer=None) -> tuple[OpTracer, bool, list[str]]:
    """The batch op by op: the tracer, whether the loss is finite, the bad variables."""
    variables = list(model.trainable_variables)
    tracer = OpTracer() if tracer is None else tracer
    tf_filtering = tf.debugging.is_traceback_filtering_enabled()
    keras_filtering = keras.config.is_traceback_filtering_enabled()
    state = model_state(model)
    try:
        tf.debugging.disable_traceback_filtering()
        keras.config.disable_traceback_filtering()
        with eager_trace(tracer):
            with tf.GradientTape() as tape:
                tracer.stage = "forward"
                y_pred = model(x, training=True)
                tracer.stage = "loss"
                value = loss_fn(x, y_true, y_pred, weights)
            tracer.stage = "backward"
            grads = tape.gradient(value, variables)
    finally:
        restore(state)
        if tf_filtering:
            tf.debugging.enable_traceback_filtering()
        if keras_filtering:
            keras.config.enable_traceback_filtering()
    loss_finite = bool(np.all(np.isfinite(np.asarray(tf.cast(value, tf.float32)))))
    bad = [
        _variable_path(v)
        for v, g in zip(variables, grads)
        if g is not None and nonfinite_mask(np.asarray(gradient_values(g).numpy())).any()
    ]
    return tracer, loss_finite, bad


def _mode_names(jit: bool) -> str:
    return "the XLA-compiled step" if jit else "the compiled step"


def _diagnose_batch(model, loss_fn, index, x, y_true, weights, compiled, jit, fallback, losses_before):
    bad_data = nonfinite_data((x, y_true, weights))
    if bad_data:
        return _input_diagnosis(index, bad_data, compiled)
    if compiled.get("reproduced") is False:
        return _not_reproduced(index, compiled)
    weights_found = _weights_diagnosis(model, index, compiled, losses_before)
    if weights_found is not None:
        return weights_found
    own = loss_fn is None
    if own:  # an optimizer's update that writes NaN from finite gradients: named as such
        found = own_step_update(model, x, y_true, weights, index)
        if found is not None:
            return replace(found, symptom=symptom(compiled))
    tracer = OpTracer()
    try:
        if own:
            tracer, loss_finite, bad_variables = rerun_own(model, x, y_true, weights, tracer)
        else:
            tracer, loss_finite, bad_variables = rerun(model, loss_fn, x, y_true, weights, tracer)
    except Exception as error:  # an eager kernel that checks what the compiled one did not
        event = culprit(tracer)
        at = "after" if event is not None else "at"
        event = event or raised(error, tracer)  # the op whose eager kernel refused what XLA's made NaN of
        if event is None:
            return _rerun_failed(index, compiled, error)
        first = (str(error).strip().splitlines() or [""])[0][:200]
        return replace(
            from_event(event, tracer, index, tuple(compiled.get("variables", ())), None, event.backward,
                       losses_before),
            mode_disagreement=f"the op-by-op re-run stopped {at} this op with {type(error).__name__}: {first}",
            symptom=symptom(compiled),
        )
    eager_nonfinite = (not loss_finite) or bool(bad_variables)
    if own:
        bad_variables = list(compiled.get("variables", ())) or bad_variables
    disagreement = None
    if fallback == "XLA":
        disagreement = (
            f"the XLA-compiled step is finite on batch {index}; the step without XLA and the op-by-op "
            "re-run are not (XLA rewrites this computation: with jit_compile=False the NaN appears)"
        )
    elif fallback == "graph":
        disagreement = (
            f"the compiled step ({'XLA and ' if jit else ''}graph) is finite on batch {index}; run "
            "eagerly, op by op (as a custom eager loop runs it), it is not"
        )
    if not eager_nonfinite:
        cause = CAUSES["compiled_only"]
        return Diagnosis(
            batch=index, phase="loss" if compiled.get("loss") else "backward", op=None, forward_op=None,
            layer=None, source=None, variables=tuple(compiled.get("variables", ())), dtype=None,
            inputs_summary="every op of the op-by-op re-run is finite",
            cause="compiled_only", fix=cause.fix, section=cause.section,
            mode_disagreement=(
                f"{_mode_names(jit)} is non-finite on batch {index} ({symptom(compiled)}); "
                "the op-by-op re-run is finite"
            ),
            symptom=symptom(compiled),
        )
    if compiled.get("loss") != (not loss_finite) and fallback is None:
        disagreement = (
            f"{_mode_names(jit)} has {symptom(compiled)}; the op-by-op re-run has "
            f"{'a non-finite loss' if not loss_finite else 'a finite loss, non-finite gradients'}"
        )
    if own:
        event = culprit(tracer)
    elif not loss_finite:
        event = next((e for e in tracer.events if not e.backward), None)
    else:
        event = tracer.first(backward=True)
    if event is None:
        event = tracer.events[0] if tracer.events else None
    if event is None:  # non-finite values the tracer cannot see (e.g. inside a custom C++ op)
        cause = CAUSES["unclassified"]
        return Diagnosis(
            batch=index, phase="backward" if loss_finite else "forward", op=None, forward_op=None, layer=None,
            source=None, variables=tuple(bad_variables), dtype=None, inputs_summary="no traced op output is non-finite",
            cause="unclassified", fix=cause.fix, section=cause.section, mode_disagreement=disagreement,
            symptom=symptom({"loss": not loss_finite}),
        )
    found = from_event(event, tracer, index, tuple(bad_variables), disagreement, loss_finite, losses_before)
    return replace(found, symptom=symptom(compiled)) if own else found


