"""What :func:`~companion.training.train` does before ``fit`` runs.

The model checked (a Keras model; under several replicas, its variables made under the
strategy's scope), compiled with :func:`train`'s ``compile`` arguments unless it is
compiled so already (the optimizer of a model whose layers compute in ``float16`` put in
a ``LossScaleOptimizer``; a Keras loss checked against a dataset's target shapes), built
from a dataset's element spec, the cached :class:`~companion.training.step.GuardedStep`
of its set-up, and the history and the completed epochs of the checkpoint to resume from.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from companion import _internal
from companion.losses import check_keras_loss_shapes
from companion.optimizers import SkipNonFinite
from companion.training.checkpoints import TrainingCheckpoint
from companion.training.cluster import PEER_FAILURES
from companion.training.inputs import built_by_its_first_step
from companion.training.results import TrainingHistory
from companion.training.step import GuardedStep, model_cache


def check_model(model) -> None:
    trainer = all(callable(getattr(model, name, None)) for name in ("fit", "compile", "train_step"))
    if not (isinstance(model, keras.layers.Layer) and trainer):
        kind = "a Keras layer that is not a model" if isinstance(model, keras.layers.Layer) else type(model).__name__
        raise TypeError(f"model must be a Keras model (keras.Model, e.g. keras.Sequential([layer])), got {kind}")


def check_scope(model, strategy) -> None:
    outside = [v.path for v in model.variables if not strategy.extended.variable_created_in_scope(v.value)]
    if outside:
        raise ValueError(
            f"the model's variables (e.g. {outside[0]!r}) were not created under the strategy's scope; "
            "create the model and the optimizer inside `with strategy.scope():`"
        )


def _compile_identity(value):
    """What identifies a compile argument: strings and numbers by value, objects by identity."""
    if isinstance(value, dict):
        return tuple(sorted((str(k), _compile_identity(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_compile_identity(v) for v in value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return ("object", id(value))


def compile_model(model, x, y, *, loss, optimizer, **options) -> None:
    """``model.compile`` with these arguments, unless the model is compiled so already."""
    if isinstance(optimizer, SkipNonFinite):
        optimizer = optimizer.inner_optimizer  # train guards by itself
    if optimizer is None:
        optimizer = "rmsprop"  # compile's default
    if options["steps_per_execution"] is None:
        options["steps_per_execution"] = 1
    key = _compile_identity((loss, optimizer, sorted(options.items())))
    cache = model_cache(model)
    current = getattr(model, "optimizer", None)
    same_optimizer = current is optimizer or getattr(current, "inner_optimizer", None) is optimizer
    if cache.get("compiled") == key and same_optimizer and getattr(model, "compiled", False):
        return
    if isinstance(x, tf.data.Dataset) and loss is not None and not isinstance(loss, (dict, list, tuple)):
        _check_target_shapes(model, loss, x.element_spec)
    optimizer = _loss_scaled(model, optimizer, options["auto_scale_loss"])
    model.compile(optimizer=optimizer, loss=loss, **options)
    cache["compiled"] = key


def _loss_scaled(model, optimizer, auto_scale_loss):
    """The optimizer in a ``LossScaleOptimizer`` if some layer computes in float16.

    ``compile`` wraps it only when the *model's* policy is ``mixed_float16`` (the global
    policy); a model whose layers were given ``dtype="mixed_float16"`` one by one would
    then train in float16 without loss scaling, and small gradients underflow.
    """
    if not auto_scale_loss or isinstance(optimizer, (str, keras.optimizers.LossScaleOptimizer)):
        return optimizer
    if getattr(getattr(model, "dtype_policy", None), "name", None) == "mixed_float16":
        return optimizer  # compile wraps it
    policies = {getattr(getattr(layer, "dtype_policy", None), "name", None) for layer in _internal.all_layers(model)}
    if "mixed_float16" in policies and isinstance(optimizer, keras.optimizers.Optimizer):
        return keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


def _check_target_shapes(model, loss, spec) -> None:
    """Keras' own losses: targets that would broadcast into a wrong comparison raise now."""
    if not (isinstance(spec, tuple) and len(spec) >= 2 and isinstance(spec[1], tf.TensorSpec)):
        return
    if not model.built or not isinstance(spec[0], tf.TensorSpec):
        return
    try:
        predictions = model.compute_output_spec(keras.KerasTensor(spec[0].shape, dtype=spec[0].dtype.name))
    except Exception:  # noqa: BLE001 - a model that cannot say: nothing to check
        return
    if isinstance(predictions, keras.KerasTensor):
        check_keras_loss_shapes(loss, spec[1], predictions)


def build_model(model, x) -> None:
    """Build an unbuilt model from a dataset's element spec (fit would at its first step);
    not a model whose own ``train_step`` builds what it uses at its first step, as in fit
    (its ``call`` may take other inputs than the data: a GAN's generator, a denoiser)."""
    if model.built or not isinstance(x, tf.data.Dataset) or built_by_its_first_step(model):
        return
    spec = x.element_spec
    inputs = spec[0] if isinstance(spec, tuple) else spec
    try:
        model(tf.nest.map_structure(lambda s: keras.KerasTensor(s.shape, dtype=s.dtype.name), inputs))
    except Exception:  # noqa: BLE001 - fit builds it at its first step instead
        pass


def guarded_step(model, strategy, *, guard, clip, limit, spikes=None, defer=True) -> GuardedStep:
    """The cached :class:`GuardedStep` for this set-up (a new one after ``compile``)."""
    cache = model_cache(model)
    key = (
        "step", id(model.optimizer), id(strategy), guard, clip, limit, spikes, int(model.steps_per_execution), defer,
        tuple(id(v) for v in model.trainable_variables), tuple(id(v) for v in model.metrics_variables),
        tuple(id(v) for v in model.non_trainable_variables),
    )
    step = cache.get(key)
    if step is None or step.optimizer is not model.optimizer:
        step = GuardedStep(
            model, strategy, capacity=int(model.steps_per_execution), guard=guard, clip=clip, limit=limit,
            spikes=spikes, defer=defer,
        )
        cache[key] = step
    return step


def resume(model, cluster, checkpoint_dir) -> tuple[TrainingHistory, int, TrainingCheckpoint | None]:
    """The history and the number of completed epochs: from the latest checkpoint, if any."""
    history, start_epoch, checkpoint = TrainingHistory(), 0, None
    if checkpoint_dir is not None:
        checkpoint = TrainingCheckpoint(checkpoint_dir, model, model.optimizer, cluster)
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
