"""The host loop of :func:`companion.training.train`: validate, prepare, then per epoch run
host calls of several compiled steps, record what they did, and adapt the number of
steps per call (chapter *The guarded training loop*).
"""

from __future__ import annotations

import bisect
import os
import time
import warnings
from typing import Any, Callable, Iterable

import keras
import numpy as np
import tensorflow as tf

from companion import _tf_internals
from companion.diagnostics import GradientRecord, GradientReport
from companion.diagnostics.hooks import diagnose_skipped_step
from companion.training.cluster import PEER_FAILURES, arm_exit_after_worker_loss
from companion.training.inputs import as_dataset, check_arguments, validation_dataset
from companion.training.masking import UnmaskableUpdate
from companion.training.prepare import Run, prepare
from companion.training.results import NonFiniteError, SkippedStep, TrainingHistory, WorkerLostError
from companion.training.step import Runner, model_cache

#: Seconds of work per host call the loop aims for (also the progress-bar refresh interval).
TARGET_SECONDS_PER_CALL = 0.2
MAX_STEPS_PER_CALL = 1024
#: A dynamic loss scale at or below this value no longer amplifies the gradients.
STALLED_LOSS_SCALE = 1.0


def train(
    model: keras.layers.Layer,
    dataset: tf.data.Dataset | Iterable[tuple[Any, Any]],
    *,
    loss: Callable | str,
    optimizer: keras.optimizers.Optimizer,
    epochs: int = 1,
    callbacks: list[keras.callbacks.Callback] | None = None,
    validation_data: tf.data.Dataset | tuple | None = None,
    metrics: list | dict | None = None,
    loss_weights: float | list | dict | None = None,
    strategy: tf.distribute.Strategy | None = None,
    jit_compile: bool = True,
    clip_global_norm: float | None = None,
    on_nonfinite: str = "skip",
    max_consecutive_nonfinite: int = 10,
    checkpoint_dir: str | os.PathLike | None = None,
    on_worker_loss: str = "exit",
    verbose: int = 1,
) -> TrainingHistory:
    """Train ``model`` on ``dataset``, skipping every step whose loss or gradients are not finite.

    ``train`` keeps ``model.fit``'s contracts: the model is compiled with ``loss``,
    ``loss_weights``, ``metrics`` and ``optimizer`` as ``compile`` would, each step
    computes the loss as ``fit`` does (``model.compute_loss``: sample weights, a loss per
    output, regularisation losses, the optimizer's ``loss_scale_factor``), ``callbacks``
    are driven as ``fit`` drives them (batch hooks once per host call, as with
    ``steps_per_execution``; ``model.stop_training`` is honoured), ``validation_data`` is
    evaluated with ``model.evaluate`` after every epoch, and the optimizer's
    ``finalize_variable_values`` (its EMA) runs at the end. With the same weights and
    batches, and no skipped step, the weights and every logged number equal ``fit``'s.

    What ``fit`` does not do: each step also computes its gradients' global norm and
    whether the loss and every gradient are finite their global norm and whether the
    loss and every gradient are finite (the norm is NaN or Inf as soon as one entry is;
    finite gradients whose norm overflows float32, above ~1.8e19, count as non-finite
    too). A non-finite step applies nothing: the weights, the optimizer's moments and
    iteration counter, the model variables the forward pass changed (batch-norm
    statistics, dropout seed state) and the metrics keep their exact previous values,
    so a skipped step does not poison the epoch's loss or metrics (and
    ``keras.callbacks.TerminateOnNaN`` never fires under the guard). Several steps run
    per host call, XLA-compiled, without a host round trip per step.

    * Distribution: under a ``tf.distribute`` strategy the gradients are summed across
      replicas before the test, so a NaN on one replica skips the step on all; the
      model and optimizer must be created under ``strategy.scope()``, ``dataset``
      yields global batches, and the loss is the mean over the global batch.
    * Several machines: under ``tf.distribute.MultiWorkerMirroredStrategy`` every
      worker calls ``train`` with the same arguments (see :mod:`companion.launch`);
      only the chief shows progress and writes ``checkpoint_dir`` (which every worker
      must see), and a lost peer raises :class:`WorkerLostError` on every survivor
      (see ``on_worker_loss``). Each worker's TensorFlow server listens on every
      interface of its machine, whatever host ``TF_CONFIG`` names, without
      authentication, and runs the graphs it is sent: TensorFlow's SECURITY.md requires
      the cluster's network to be isolated. :func:`companion.launch.launch` runs local
      workers in a private, loopback-only network namespace.
    * XLA: if the step cannot be compiled (an op without an XLA kernel, such as
      ``tf.py_function``), it runs without XLA and a warning says so.
    * Mixed precision: a float16 model gets a :class:`keras.optimizers.LossScaleOptimizer`
      (kept with the model across calls); an overflowing step is skipped and halves the
      loss scale. If the scale falls to 1, ``history.loss_scale_stalled`` is set and a
      warning says the NaNs are not float16 overflow.
    * Checkpoints: with ``checkpoint_dir``, the model, the optimizer, the number of
      completed epochs and the history are saved at every epoch end (the last two are
      kept); calling ``train`` again with the same directory resumes after the last
      completed epoch and ends bit-identical to an uninterrupted run on CPU, provided
      each epoch yields the same batches.

    The design and its cost are in the chapter *The guarded training loop*; several
    machines in *Training across machines*.

    Args:
        model: a Keras model (any :class:`keras.layers.Layer` with trainable
            variables); an unbuilt model is built from the dataset's element spec.
        dataset: a ``tf.data.Dataset`` of ``(inputs, targets)`` or ``(inputs, targets,
            sample_weights)`` batches with a finite number of batches, or any finite
            iterable of such tuples (read once, kept in memory).
        loss: as for ``compile``: ``loss(y_true, y_pred)``, a :class:`keras.losses.Loss`,
            a Keras loss name such as ``"mse"``, or a list or dict of them, one per
            output. A user's callable is called as ``fit`` calls it (it may read extra
            target columns); for Keras' own losses, targets and predictions that would
            broadcast into a wrong comparison raise ``ValueError`` before any step.
        optimizer: a :class:`keras.optimizers.Optimizer`, built on the model's
            trainable variables if it is not built yet.
        epochs: total number of passes over ``dataset`` (restored epochs included), >= 1.
        callbacks: :class:`keras.callbacks.Callback` instances (``EarlyStopping``,
            ``ModelCheckpoint``, ``ReduceLROnPlateau``, ``CSVLogger``, ...).
        validation_data: a dataset, or an ``(x, y)`` or ``(x, y, sample_weight)`` tuple
            of arrays (batched by 32), evaluated after every epoch; its logs get ``val_``.
        metrics: as for ``compile``: names, :class:`keras.metrics.Metric` instances or
            callables, in a list or a dict per output; computed on the applied steps.
        loss_weights: as for ``compile``: a weight per output (a list or dict).
        strategy: a ``tf.distribute.Strategy``; default: the model's, else the current one.
        jit_compile: compile the step with XLA.
        clip_global_norm: if given (> 0), finite gradients are rescaled so that their
            global norm is at most this value (:func:`tf.clip_by_global_norm`
            semantics). Non-finite gradients are never clipped, which would spread one
            NaN to every variable. The optimizer's own ``clipnorm``, ``clipvalue`` and
            ``global_clipnorm`` act as in ``fit``, after this, inside ``apply`` (they
            only ever see finite gradients here).
        on_nonfinite: ``"skip"`` (skip the step and go on), ``"raise"`` (raise
            :class:`NonFiniteError` at the first non-finite step, which is not applied
            either), or ``"ignore"`` (no check: every step is applied, NaN included, as
            ``model.fit`` does; for measuring what the guard costs).
        max_consecutive_nonfinite: with ``"skip"``, raise :class:`NonFiniteError` after
            this many consecutive skipped steps (>= 1); the weights are then exactly
            those of the last good step.
        checkpoint_dir: directory for epoch-end checkpoints, or ``None``.
        on_worker_loss: what happens to this process after :class:`WorkerLostError`:
            ``"exit"`` (it ends with exit code 1 at interpreter exit, without
            TensorFlow's teardown, and at the latest 30 s after the error, so that a
            scheduler can restart the job: TensorFlow's runtime can otherwise keep it
            alive, blocked on the lost peer) or ``"raise"`` (only raise). What bounds a
            survivor's exit: detecting the loss (a crashed peer breaks the connection at
            once; a crashed or stopped one stops its heartbeats to TensorFlow's
            coordination service, which aborts the collectives within about ten seconds;
            a collective timeout, if the strategy sets one, bounds any wait), then at most
            30 s. The tests kill workers at every moment of training and require 60 s.
        verbose: 0 prints nothing, 1 shows Keras' progress bar per epoch, 2 prints one
            line per epoch.

    Returns:
        A :class:`TrainingHistory` with the loss, gradient norm and finiteness of every
        step, a report per skipped step, and in ``.history`` the per-epoch logs that
        ``fit``'s ``History`` would hold (``model.history`` is that ``History``).

    Raises:
        TypeError: if an argument has the wrong type (``model`` not a Keras model,
            ``optimizer`` not a Keras optimizer, ``loss`` not callable, a callback that
            is not a ``keras.callbacks.Callback``, ...) or ``dataset`` does not yield
            ``(inputs, targets[, sample_weights])`` tuples.
        ValueError: if an argument is out of range, the dataset is empty or infinite,
            a metric name is unknown, a loss dict's keys are not the model's outputs,
            ``validation_data`` does not have the training data's structure, a Keras
            loss would compare predictions with the wrong targets, the model has no
            trainable variables or was not created under the strategy's scope, or
            ``checkpoint_dir`` holds a checkpoint of another model. All of these are
            raised before any step runs.
        NonFiniteError: see ``on_nonfinite`` and ``max_consecutive_nonfinite``.
        WorkerLostError: under a multi-worker strategy, when another worker crashed or
            stopped responding.

    Example:
        >>> model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        >>> x = np.array([[1.0], [2.0], [np.nan], [4.0]], "float32")
        >>> data = tf.data.Dataset.from_tensor_slices((x, 2 * x)).batch(1)
        >>> sgd = keras.optimizers.SGD(0.01)
        >>> history = train(model, data, loss="mse", optimizer=sgd, epochs=2, verbose=0)
        >>> history.skipped
        [2, 6]
    """
    args = check_arguments(
        model, loss, optimizer, epochs=epochs, strategy=strategy, jit_compile=jit_compile,
        clip_global_norm=clip_global_norm, on_nonfinite=on_nonfinite,
        max_consecutive_nonfinite=max_consecutive_nonfinite, checkpoint_dir=checkpoint_dir, verbose=verbose,
        callbacks=callbacks, metrics=metrics, loss_weights=loss_weights,
    )
    if on_worker_loss not in ("exit", "raise"):
        raise ValueError(f"on_worker_loss must be 'exit' or 'raise', got {on_worker_loss!r}")
    dataset = as_dataset(dataset)
    validation = validation_dataset(validation_data, dataset.element_spec)
    try:
        return _train(model, dataset, validation, args)
    except WorkerLostError:
        if on_worker_loss == "exit":
            arm_exit_after_worker_loss()
        raise


def _train(model, dataset, validation, args) -> TrainingHistory:
    run = prepare(model, dataset, validation=validation, **args)
    model.stop_training = False
    run.callbacks.on_train_begin()
    logs = None
    for epoch in range(run.start_epoch, run.epochs):
        try:
            logs = _run_epoch(run, epoch)
        except PEER_FAILURES as error:
            # Any collective of the epoch, not only the step's: e.g. reading the metrics'
            # sync-on-read variables for the logs is an eager all-reduce across workers.
            if run.cluster is None:
                raise
            raise run.lost(error, epoch) from error
        if model.stop_training:
            break
    if run.start_epoch < run.epochs:
        # As fit does at the end: e.g. write the optimizer's moving averages (use_ema).
        run.optimizer.finalize_variable_values(model.trainable_weights)
    run.callbacks.on_train_end(logs=logs)
    return run.history


# --------------------------------------------------------------------------------------
# One epoch: host calls, records, adaptation
# --------------------------------------------------------------------------------------


def _run_epoch(run: Run, epoch: int) -> dict[str, Any]:
    """One epoch, driven as ``fit`` drives it; returns the epoch's logs."""
    history, model = run.history, run.model
    model.reset_metrics()
    run.callbacks.on_epoch_begin(epoch)
    iterator = run.shared_iterator if run.shared_iterator is not None else iter(run.distributed)
    epoch_start = history.steps
    applied_losses: list[float] = []
    consecutive = history.trailing_nonfinite()
    done = False
    while not done and not model.stop_training:
        steps_asked = run.runner.steps_per_call
        if run.known_length:
            steps_asked = min(steps_asked, run.steps_per_epoch - (history.steps - epoch_start))
        begin_step = history.steps - epoch_start
        run.callbacks.on_train_batch_begin(begin_step)
        result = _host_call(run, iterator, epoch, steps_asked, consecutive)
        if result is _RETRY:  # the runner changed before any step ran: ask again
            continue
        if result is _RETRY_FRESH:  # ... and the failed call may have consumed a batch
            iterator = iter(run.distributed)
            if run.shared_iterator is not None:
                run.shared_iterator = iterator
            continue
        out, elapsed = result
        steps, consecutive = int(out["steps"]), int(out["consecutive"])
        if run.known_length:
            done = history.steps + steps - epoch_start >= run.steps_per_epoch
        else:
            done = bool(out["done"])
        _record(run, out, epoch, applied_losses)
        _watch_loss_scale(run)
        if consecutive >= run.limit:
            raise _nonfinite_error(history, consecutive, run.limit, run.on_nonfinite, run.loss_scaled)
        if steps:
            run.callbacks.on_train_batch_end(begin_step + steps - 1, _logs(run, epoch_start, final=False))
        _adapt_steps_per_call(run.runner, steps, elapsed)
    return _end_epoch(run, epoch, epoch_start, applied_losses)


def _logs(run: Run, epoch_start: int, *, final: bool) -> dict[str, Any]:
    """The logs ``fit`` would pass to callbacks (the model's metrics), plus skipped steps."""
    logs = {}
    for name, value in run.model.get_metrics_result().items():
        value = np.asarray(value)
        logs[name] = float(value) if value.ndim == 0 else value.tolist()
    skipped = len(run.history.skipped) - bisect.bisect_left(run.history.skipped, epoch_start)
    if final or skipped:
        logs["skipped"] = skipped
    return logs


_RETRY = object()
_RETRY_FRESH = object()


def _host_call(run: Run, iterator, epoch: int, steps_asked: int, consecutive: int):
    """Run up to ``steps_asked`` steps: their records and the seconds they took.

    Returns ``_RETRY`` (same iterator) or ``_RETRY_FRESH`` (new iterator) when the
    runner had to change before any step was applied.

    Two fall-backs are found on the first call, before any step has been applied: an
    update that cannot be masked (it is then put under a conditional) and a step XLA
    cannot compile (it then runs without XLA, with a warning).
    """
    runner = run.runner
    started = time.perf_counter()
    try:
        out = runner.run(iterator, steps_asked, consecutive, run.limit, run.known_length)
    except UnmaskableUpdate:
        model_cache(run.model)[("unmaskable", id(run.optimizer))] = True
        run.runner = run.make_runner(jit=runner.jit, masked=False)
        return _RETRY
    except tf.errors.OpError as error:
        if run.cluster is not None and isinstance(error, PEER_FAILURES):
            raise run.lost(error, epoch) from error
        if runner.jit and not runner.verified and _tf_internals.looks_like_xla_failure(error):
            warnings.warn(
                f"XLA could not compile the training step ({_tf_internals.xla_failure_summary(error)}); "
                "training without XLA. Pass jit_compile=False to skip this attempt.",
                RuntimeWarning,
                stacklevel=4,
            )
            run.runner = run.make_runner(jit=False)
            run.model.jit_compile = False  # model.evaluate (validation) would fail the same way
            return _RETRY_FRESH
        raise
    elapsed = time.perf_counter() - started
    if run.cluster is not None:
        # Every worker must ask for the same number of steps per call.
        try:
            elapsed = float(run.cluster.gather(elapsed).max())
        except PEER_FAILURES as error:
            raise run.lost(error, epoch) from error
    runner.verified = True
    run.history.xla = runner.jit
    run.history.update = runner.mode
    return out, elapsed


def _record(run: Run, out: dict[str, np.ndarray], epoch: int, applied_losses: list[float]) -> None:
    """Append the steps of one host call to the history, with a report per skipped step."""
    history = run.history
    first_index = history.steps
    scalars = out["scalars"]
    skip_rows = {int(k): row for row, k in enumerate(out["skip_index"])}
    for k in range(int(out["steps"])):
        index = first_index + k
        step_loss = float(scalars[k, 0])
        history.step_loss.append(step_loss)
        history.grad_norm.append(float(scalars[k, 1]))
        scale = float(scalars[k, 3]) if run.loss_scaled else None
        if run.loss_scaled:
            history.loss_scale.append(scale)
        if scalars[k, 2] > 0.5:
            applied_losses.append(step_loss)
            continue
        history.skipped.append(index)
        nan_counts, inf_counts = out["counts"][skip_rows[k]]
        records = [
            GradientRecord(
                path=str(v.path),
                shape=tuple(int(d) for d in v.shape),
                nan_count=int(nan_counts[i]),
                inf_count=int(inf_counts[i]),
                max_abs=None,
            )
            for i, v in enumerate(run.runner.variables)
            if nan_counts[i] or inf_counts[i]
        ]
        history.reports.append(
            SkippedStep(
                step=index, epoch=epoch, loss=step_loss, gradients=GradientReport(records), loss_scale=scale,
                grad_norm=history.grad_norm[-1],
                # The NaN doctor, once per run: on the first skipped step only (on every
                # worker: the hook's exchange is a collective every worker must join).
                diagnosis=None if history.reports else diagnose_skipped_step(run, index),
            )
        )


def _watch_loss_scale(run: Run) -> None:
    """Warn once if the dynamic loss scale fell so low that the NaNs cannot be overflow."""
    history = run.history
    if not run.loss_scaled or history.loss_scale_stalled:
        return
    current = float(tf.convert_to_tensor(run.runner.loss_scaler.dynamic_scale).numpy())
    if current <= STALLED_LOSS_SCALE:
        history.loss_scale_stalled = True
        warnings.warn(
            f"the dynamic loss scale fell to {current:g} by step {history.steps - 1}: the gradients are "
            "non-finite even without float16 overflow, so loss scaling cannot fix them (and small "
            "gradients now underflow). Look for the NaN with companion.diagnostics.locate_nonfinite.",
            RuntimeWarning,
            stacklevel=4,
        )


def _adapt_steps_per_call(runner: Runner, steps: int, elapsed: float) -> None:
    """Aim for a few host calls per second; the number of steps per call does not change results."""
    requested = runner.steps_per_call
    if steps == requested and elapsed < TARGET_SECONDS_PER_CALL / 2:
        runner.steps_per_call = min(requested * 2, MAX_STEPS_PER_CALL)
    elif elapsed > 2 * TARGET_SECONDS_PER_CALL and requested > 1 and steps > 1:
        runner.steps_per_call = max(requested // 2, 1)


def _end_epoch(run: Run, epoch: int, epoch_start: int, applied_losses: list[float]) -> dict[str, Any]:
    """Close the epoch: its logs (validation included), callbacks, history, checkpoint."""
    history = run.history
    epoch_steps = history.steps - epoch_start
    if epoch_steps == 0:
        raise ValueError("dataset yielded no batch in this epoch")
    history.epoch_steps.append(epoch_steps)
    history.epoch_loss.append(float(np.mean(applied_losses)) if applied_losses else float("nan"))
    logs = _logs(run, epoch_start, final=True)
    if run.validation is not None:
        try:
            results = run.model.evaluate(run.validation, callbacks=run.callbacks, return_dict=True, verbose=0)
        except PEER_FAILURES as error:
            if run.cluster is None:
                raise
            raise run.lost(error, epoch) from error
        logs.update({f"val_{name}": float(np.asarray(value)) for name, value in results.items()})
    run.callbacks.on_epoch_end(epoch, logs)
    # What Keras' History recorded: the logs after every callback added to them (e.g.
    # learning_rate); the earlier epochs of a resumed run come from the checkpoint.
    recorded = next(c for c in run.callbacks.callbacks if isinstance(c, keras.callbacks.History)).history
    for name, values in recorded.items():
        history.history.setdefault(name, []).append(values[-1])
    if run.checkpoint is not None:
        try:
            run.checkpoint.save(epoch + 1, history)
        except PEER_FAILURES as error:
            if run.cluster is None:
                raise
            raise run.lost(error, epoch) from error
    return logs


def _nonfinite_error(history, consecutive, limit, on_nonfinite, loss_scaled) -> NonFiniteError:
    reports = tuple(history.reports[-consecutive:])
    last = reports[-1]
    if on_nonfinite == "raise":
        head = f"non-finite loss or gradients at step {last.step} (epoch {last.epoch}) with on_nonfinite='raise'"
    else:
        head = (
            f"{consecutive} consecutive steps with non-finite loss or gradients "
            f"(max_consecutive_nonfinite={limit}), the last at step {last.step} (epoch {last.epoch})"
        )
    if last.gradients:
        variables = ", ".join(f"{r.path} ({r.nan_count} NaN, {r.inf_count} Inf)" for r in last.gradients)
        detail = f"loss {last.loss:.6g}; non-finite gradients in {variables}"
    else:
        detail = f"loss {last.loss:.6g}; {last.cause()}"
    if loss_scaled:
        detail += f"; loss scale {reports[0].loss_scale:g} -> {last.loss_scale:g}"
    good = reports[0].step - 1
    state = f"after step {good}" if good >= 0 else "at the start of training"
    return NonFiniteError(
        f"{head}: {detail}. No update was applied on these steps: the weights and optimizer state are those {state}.",
        step=last.step,
        epoch=last.epoch,
        reports=reports,
        history=history,
    )
