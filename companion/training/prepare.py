"""Preparing a call of :func:`companion.training.train`: the strategy, the optimizer (with
loss scaling for float16), the model compiled as ``compile`` would compile it, the
checkpoint to resume from, the compiled runner, the input pipeline and the callbacks.
Everything :func:`prepare` returns is one :class:`Run`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import keras
import tensorflow as tf

from companion import _tf_internals
from companion.losses import check_keras_loss_shapes
from companion.training.checkpoints import TrainingCheckpoint
from companion.training.cluster import PEER_FAILURES, Cluster
from companion.training.inputs import prepare_model, prepare_optimizer, uses_float16
from companion.training.results import TrainingHistory
from companion.training.step import Runner, loss_scale_wrapper, model_cache, runner_for

@dataclasses.dataclass
class Run:
    """Everything one call of ``train`` works with."""

    model: Any
    loss: Callable
    optimizer: Any
    strategy: tf.distribute.Strategy
    epochs: int
    clip: float | None
    guard: bool
    on_nonfinite: str
    limit: int
    verbose: int
    cluster: Cluster | None
    checkpoint: TrainingCheckpoint | None
    history: TrainingHistory
    start_epoch: int
    runner: Runner
    distributed: Any
    shared_iterator: Any
    steps_per_epoch: int
    validation: tf.data.Dataset | None
    callbacks: keras.callbacks.CallbackList

    @property
    def known_length(self) -> bool:
        return self.steps_per_epoch > 0

    @property
    def loss_scaled(self) -> bool:
        return self.runner.loss_scaler is not None

    def lost(self, error: Exception, epoch: int):
        """The WorkerLostError for a collective that failed because a peer is gone."""
        return self.cluster.lost(error, epoch, self.history, self.checkpoint)

    def make_runner(self, *, jit: bool, masked: bool = True) -> Runner:
        return runner_for(
            self.model, self.optimizer, self.strategy, jit=jit, clip=self.clip, guard=self.guard, masked=masked
        )


def _compile_identity(value):
    """What identifies a compile argument: strings and numbers by value, objects by identity."""
    if isinstance(value, dict):
        return tuple(sorted((k, _compile_identity(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_compile_identity(v) for v in value)
    if value is None or isinstance(value, (str, int, float)):
        return value
    return ("object", id(value))


def _compile(model, *, loss, optimizer, metrics, loss_weights, jit_compile, spec) -> None:
    """Compile ``model`` as ``fit`` needs it, unless it is compiled so already, and build its state."""
    key = _compile_identity((loss, optimizer, metrics, loss_weights, jit_compile))
    cache = model_cache(model)
    if cache.get("compiled") != key or getattr(model, "optimizer", None) is not optimizer:
        model.compile(
            optimizer=optimizer, loss=loss, loss_weights=loss_weights, metrics=metrics,
            jit_compile=jit_compile,
        )
        cache["compiled"] = key
        _tf_internals.build_compiled_state(model, spec)


def _check_target_shapes(model, loss, spec) -> None:
    """Keras' own losses: targets that would broadcast into a wrong comparison raise now."""
    inputs = tf.nest.map_structure(lambda s: keras.KerasTensor(s.shape, dtype=s.dtype.name), spec[0])
    predictions = model.compute_output_spec(inputs) if hasattr(model, "compute_output_spec") else None
    if predictions is None:
        return
    targets = spec[1]
    if not isinstance(loss, (dict, list, tuple)):
        if tf.is_tensor(predictions) or isinstance(predictions, keras.KerasTensor):
            if isinstance(targets, tf.TensorSpec):
                check_keras_loss_shapes(loss, targets, predictions)
        return
    names = list(getattr(model, "output_names", None) or [])
    flat_predictions = tf.nest.flatten(predictions)
    if isinstance(loss, dict) and isinstance(targets, dict):
        pairs = [(loss[k], targets.get(k), flat_predictions[names.index(k)]) for k in loss if k in names]
    elif isinstance(loss, (list, tuple)) and isinstance(targets, (list, tuple)):
        pairs = list(zip(loss, targets, flat_predictions))
    else:
        return
    for entry, target, prediction in pairs:
        if entry is not None and isinstance(target, tf.TensorSpec):
            check_keras_loss_shapes(entry, target, prediction)


def prepare(
    model, dataset, *, loss, optimizer, epochs, strategy, jit_compile, clip_global_norm, on_nonfinite,
    max_consecutive_nonfinite, checkpoint_dir, verbose, callbacks, metrics, loss_weights, validation,
) -> Run:
    if strategy is None:
        strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
    spec = dataset.element_spec
    with strategy.scope():
        prepare_model(model, spec[0], strategy)
        if uses_float16(model) and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = loss_scale_wrapper(model, optimizer)
        prepare_optimizer(optimizer, model)
        _check_target_shapes(model, loss, spec)
        _compile(
            model, loss=loss, optimizer=optimizer, metrics=metrics, loss_weights=loss_weights,
            jit_compile=jit_compile, spec=spec,
        )

    cluster = Cluster.of(strategy)
    if cluster is not None and not cluster.is_chief:
        verbose = 0  # one progress bar, the chief's
    history, start_epoch, checkpoint = _resume(model, optimizer, cluster, checkpoint_dir)

    steps_per_epoch = int(dataset.cardinality())
    # Under a multi-worker strategy a new iterator costs a good fraction of a second, so
    # with a known number of batches one iterator over the repeated dataset serves every
    # epoch (each takes its batches from it; a shuffle still reshuffles per epoch).
    shared = cluster is not None and steps_per_epoch > 0
    distributed = strategy.experimental_distribute_dataset(dataset.repeat() if shared else dataset)
    guard = on_nonfinite != "ignore"
    run = Run(
        model=model, loss=loss, optimizer=optimizer, strategy=strategy, epochs=epochs, clip=clip_global_norm,
        guard=guard, on_nonfinite=on_nonfinite,
        limit=1 if on_nonfinite == "raise" else max_consecutive_nonfinite,
        verbose=verbose, cluster=cluster, checkpoint=checkpoint, history=history, start_epoch=start_epoch,
        runner=None, distributed=distributed, shared_iterator=iter(distributed) if shared else None,
        steps_per_epoch=steps_per_epoch, validation=validation,
        callbacks=keras.callbacks.CallbackList(
            callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose, epochs=epochs,
            steps=steps_per_epoch if steps_per_epoch > 0 else None, model=model,
        ),
    )
    run.runner = run.make_runner(jit=jit_compile)
    return run


def _resume(model, optimizer, cluster, checkpoint_dir) -> tuple[TrainingHistory, int, TrainingCheckpoint | None]:
    """The history and first epoch to run: from the latest checkpoint, if there is one."""
    history, start_epoch, checkpoint = TrainingHistory(), 0, None
    if checkpoint_dir is not None:
        checkpoint = TrainingCheckpoint(checkpoint_dir, model, optimizer, cluster)
        restored = checkpoint.restore()
        if restored is not None:
            start_epoch, history = restored
    if cluster is not None:
        try:
            restored_epochs = sorted({int(v) for v in cluster.gather(start_epoch)[:, 0]})
        except PEER_FAILURES as error:
            raise cluster.lost(error, start_epoch, history, checkpoint) from error
        if len(restored_epochs) > 1:
            raise ValueError(
                f"the workers restored different checkpoints from {checkpoint_dir!r} (after epochs "
                f"{restored_epochs}; {cluster.task} after epoch {start_epoch}): every worker must see the chief's "
                "checkpoint_dir, e.g. on a shared file system"
            )
    return history, start_epoch, checkpoint
