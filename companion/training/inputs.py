"""Input checks of :func:`companion.training.train`: every error a caller can cause is
raised here, before any step runs, with a message that says what was given and what is
expected.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import keras
import numpy as np
import tensorflow as tf

from companion import _tf_internals
from companion._checks import check_bool, check_int, check_positive_number
from companion.losses import resolve_loss
from companion.optimizers import SkipNonFinite

#: What ``on_nonfinite`` may be: skip the step, raise at once, or apply every step
#: unchecked, as ``fit`` does (no guard; for measuring what the guard costs).
ON_NONFINITE = ("skip", "raise", "ignore")


def _describe_spec(spec) -> str:
    if isinstance(spec, tf.TensorSpec):
        return f"a single tensor of shape {tuple(spec.shape)} and dtype {spec.dtype.name}"
    if isinstance(spec, dict):
        return f"a dict with keys {sorted(spec)}"
    if isinstance(spec, (tuple, list)):
        return f"a {type(spec).__name__} of {len(spec)} elements"
    return f"{type(spec).__name__}"


def as_dataset(dataset, name: str = "dataset") -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of ``(inputs, targets[, sample_weights])`` with a known, finite cardinality."""
    if isinstance(dataset, tf.data.Dataset):
        spec = dataset.element_spec
        if not (isinstance(spec, (tuple, list)) and len(spec) in (2, 3)):
            raise TypeError(
                f"{name} must yield (inputs, targets) or (inputs, targets, sample_weights) tuples, but its "
                f"elements are {_describe_spec(spec)}; e.g. tf.data.Dataset.from_tensor_slices((x, y)).batch(32)"
            )
        cardinality = int(dataset.cardinality())
        if cardinality == 0:
            raise ValueError(f"{name} is empty: it yields no batch")
        if cardinality == tf.data.INFINITE_CARDINALITY:
            raise ValueError(
                f"{name} is infinite (e.g. .repeat() without a count), so an epoch would never end; "
                "use .take(steps_per_epoch) or .repeat(n)"
            )
        return dataset
    if isinstance(dataset, (str, bytes, dict)) or not isinstance(dataset, Iterable):
        raise TypeError(
            f"{name} must be a tf.data.Dataset or an iterable of (inputs, targets) batches, "
            f"got {type(dataset).__name__}"
        )
    batches = []
    for index, element in enumerate(dataset):
        if not (isinstance(element, (tuple, list)) and len(element) in (2, 3)):
            described = type(element).__name__
            if isinstance(element, (tuple, list)):
                described += f" of length {len(element)}"
            raise TypeError(
                f"{name} must yield (inputs, targets) pairs or (inputs, targets, sample_weights) triples, "
                f"but element {index} is a {described}"
            )
        try:
            batches.append(tf.nest.map_structure(tf.convert_to_tensor, tuple(element)))
        except (TypeError, ValueError) as err:
            raise TypeError(f"element {index} of {name} cannot be converted to tensors: {err}") from None
    if not batches:
        raise ValueError(f"{name} is empty: it yields no batch")
    spec = tf.nest.map_structure(tf.type_spec_from_value, batches[0])
    for index, batch in enumerate(batches[1:], start=1):
        try:
            tf.nest.assert_same_structure(batches[0], batch)
            spec = tf.nest.map_structure(
                lambda s, t: s.most_specific_common_supertype([tf.type_spec_from_value(t)]), spec, batch
            )
        except (TypeError, ValueError) as err:
            raise TypeError(f"element {index} of {name} does not have the structure of element 0: {err}") from None
        if any(s is None for s in tf.nest.flatten(spec)):
            raise TypeError(f"element {index} of {name} has a different dtype from element 0")
    result = tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=spec)
    return result.apply(tf.data.experimental.assert_cardinality(len(batches)))


def _check_loss_entry(loss, where: str):
    if isinstance(loss, str):
        resolve_loss(loss)  # an unknown name raises here, with the name
    elif loss is not None and not callable(loss):
        raise TypeError(
            f"{where} must be a callable loss(y_true, y_pred), a Keras loss or a loss name, "
            f"got {type(loss).__name__} {loss!r}"
        )


def check_losses(loss, loss_weights, model) -> None:
    """``loss`` (one, or a list or dict per output) and ``loss_weights`` as ``compile`` takes them."""
    outputs = list(getattr(model, "output_names", None) or [])
    if isinstance(loss, dict):
        for key, entry in loss.items():
            _check_loss_entry(entry, f"loss[{key!r}]")
        if not outputs:
            raise ValueError(
                f"loss has keys {sorted(loss)}, but the model's outputs are not named (a Sequential or subclassed "
                "model): pass one loss, or a list with one loss per output"
            )
        if not set(loss) <= set(outputs):
            raise ValueError(
                f"loss has keys {sorted(loss)}, but the model's outputs are named {outputs}; "
                "use the output names as keys"
            )
    elif isinstance(loss, (list, tuple)):
        for index, entry in enumerate(loss):
            _check_loss_entry(entry, f"loss[{index}]")
        if outputs and len(loss) != len(outputs):
            raise ValueError(f"loss is a list of {len(loss)} losses, but the model has {len(outputs)} outputs {outputs}")
    else:
        if loss is None:
            raise TypeError("loss must be given: a callable loss(y_true, y_pred), a Keras loss or a loss name")
        _check_loss_entry(loss, "loss")
    if loss_weights is None:
        return
    if isinstance(loss_weights, dict):
        if outputs and not set(loss_weights) <= set(outputs):
            raise ValueError(f"loss_weights has keys {sorted(loss_weights)}, but the model's outputs are {outputs}")
        values = list(loss_weights.values())
    elif isinstance(loss_weights, (list, tuple)):
        if outputs and len(loss_weights) != len(outputs):
            raise ValueError(f"loss_weights has {len(loss_weights)} entries, but the model has {len(outputs)} outputs")
        values = list(loss_weights)
    else:
        values = [loss_weights]
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"loss_weights must be numbers (or a list or dict of numbers), got {value!r}")


#: Metric names ``compile`` resolves from the loss rather than from ``keras.metrics.get``.
_LOSS_DEPENDENT_METRICS = frozenset({"accuracy", "acc", "crossentropy", "ce"})


def check_metrics(metrics) -> None:
    """``metrics`` as ``compile`` takes them: names, Keras metrics or callables, in a list or a dict."""
    if metrics is None:
        return
    if isinstance(metrics, dict):
        entries = [m for value in metrics.values() for m in (value if isinstance(value, (list, tuple)) else [value])]
    elif isinstance(metrics, (list, tuple)):
        entries = [m for value in metrics for m in (value if isinstance(value, (list, tuple)) else [value])]
    else:
        raise TypeError(f"metrics must be a list (or a dict per output) of metrics, got {type(metrics).__name__}")
    for entry in entries:
        if entry is None:
            continue
        if isinstance(entry, str):
            if entry not in _LOSS_DEPENDENT_METRICS:
                try:
                    keras.metrics.get(entry)
                except ValueError:
                    raise ValueError(f"unknown metric {entry!r}: not a Keras metric name") from None
        elif not callable(entry):
            raise TypeError(f"a metric must be a name, a keras.metrics.Metric or a callable, got {entry!r}")


def check_callbacks(callbacks) -> list:
    """``callbacks`` as a list of :class:`keras.callbacks.Callback`."""
    if callbacks is None:
        return []
    if isinstance(callbacks, keras.callbacks.Callback) or not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"callbacks must be a list of keras.callbacks.Callback, got {type(callbacks).__name__}")
    for callback in callbacks:
        if not isinstance(callback, keras.callbacks.Callback):
            raise TypeError(
                f"callbacks must be keras.callbacks.Callback instances, got {type(callback).__name__} {callback!r}"
            )
    return list(callbacks)


def validation_dataset(validation_data, train_spec) -> tf.data.Dataset | None:
    """``validation_data`` as a dataset whose inputs and targets have the training data's structure.

    A dataset is used as it is; an ``(x, y)`` or ``(x, y, sample_weight)`` tuple of arrays
    is batched by 32, as ``model.evaluate`` batches arrays.
    """
    if validation_data is None:
        return None
    if isinstance(validation_data, tf.data.Dataset):
        data = as_dataset(validation_data, "validation_data")
    elif isinstance(validation_data, (tuple, list)) and len(validation_data) in (2, 3):
        try:
            data = tf.data.Dataset.from_tensor_slices(tuple(validation_data)).batch(32)
        except (TypeError, ValueError) as err:
            raise ValueError(f"validation_data cannot be sliced into examples: {err}") from None
    else:
        raise TypeError(
            "validation_data must be a tf.data.Dataset or an (x, y) or (x, y, sample_weight) tuple, "
            f"got {type(validation_data).__name__}"
        )
    spec = data.element_spec
    for part, name in ((0, "inputs"), (1, "targets")):
        try:
            tf.nest.assert_same_structure(spec[part], train_spec[part])
        except (TypeError, ValueError):
            raise ValueError(
                f"validation_data's {name} are {_describe_spec(spec[part])}, but the training data's are "
                f"{_describe_spec(train_spec[part])}"
            ) from None
        for got, want in zip(tf.nest.flatten(spec[part]), tf.nest.flatten(train_spec[part])):
            if not got.shape[1:].is_compatible_with(want.shape[1:]):
                raise ValueError(
                    f"validation_data's {name} have shape {tuple(got.shape)} per batch, but the training data's "
                    f"have {tuple(want.shape)}"
                )
    return data


def check_arguments(
    model, loss, optimizer, *, epochs, strategy, jit_compile, clip_global_norm, on_nonfinite,
    max_consecutive_nonfinite, checkpoint_dir, verbose, callbacks, metrics, loss_weights,
) -> dict[str, Any]:
    """The arguments of ``train`` checked and normalised (numbers as Python types)."""
    if not isinstance(model, keras.Model):
        kind = "a Keras layer that is not a model" if isinstance(model, keras.layers.Layer) else type(model).__name__
        raise TypeError(
            f"model must be a Keras model (keras.Model, e.g. keras.Sequential([layer])), got {kind}"
        )
    check_losses(loss, loss_weights, model)
    check_metrics(metrics)
    callbacks = check_callbacks(callbacks)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        hint = ""
        if isinstance(optimizer, str):
            hint = " (a name like 'adam' is not accepted: pass keras.optimizers.Adam())"
        raise TypeError(
            f"optimizer must be a Keras optimizer (an instance of keras.optimizers.Optimizer), "
            f"got {type(optimizer).__module__}.{type(optimizer).__name__}{hint}"
        )
    if isinstance(optimizer, SkipNonFinite):
        optimizer = optimizer.inner_optimizer  # train() guards by itself
    epochs = check_int("epochs", epochs, 1)
    max_consecutive_nonfinite = check_int("max_consecutive_nonfinite", max_consecutive_nonfinite, 1)
    if not isinstance(on_nonfinite, str) or on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
    clip_global_norm = check_positive_number("clip_global_norm", clip_global_norm, allow_none=True)
    jit_compile = check_bool("jit_compile", jit_compile)
    if isinstance(verbose, bool) or verbose not in (0, 1, 2):
        raise ValueError(f"verbose must be 0, 1 or 2, got {verbose!r}")
    if strategy is not None and not isinstance(strategy, tf.distribute.Strategy):
        raise TypeError(f"strategy must be a tf.distribute.Strategy or None, got {type(strategy).__name__}")
    if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(
            f"checkpoint_dir must be a path (str or os.PathLike) or None, got {type(checkpoint_dir).__name__}"
        )
    return dict(
        loss=loss, optimizer=optimizer, epochs=epochs, strategy=strategy, jit_compile=jit_compile,
        clip_global_norm=clip_global_norm, on_nonfinite=on_nonfinite,
        max_consecutive_nonfinite=max_consecutive_nonfinite, checkpoint_dir=checkpoint_dir, verbose=verbose,
        callbacks=callbacks, metrics=metrics, loss_weights=loss_weights,
    )


def uses_float16(model) -> bool:
    """Whether any layer of ``model`` computes in float16 (and so needs loss scaling)."""
    for layer in _tf_internals.all_layers(model):
        policy = getattr(layer, "dtype_policy", None)
        if policy is not None and getattr(policy, "compute_dtype", None) == "float16":
            return True
    return False


def prepare_model(model, spec, strategy) -> None:
    """Build ``model`` from the dataset's element spec if needed, and check its variables."""
    if not model.built:
        inputs = tf.nest.map_structure(lambda s: keras.KerasTensor(s.shape, dtype=s.dtype.name), spec)
        model(inputs)
    if not model.trainable_variables:
        raise ValueError(f"model {model.name!r} has no trainable variables")
    if strategy.num_replicas_in_sync > 1:
        outside = [v.path for v in model.variables if not strategy.extended.variable_created_in_scope(v.value)]
        if outside:
            raise ValueError(
                f"the model's variables (e.g. {outside[0]!r}) were not created under the strategy's scope; "
                "create the model and the optimizer inside `with strategy.scope():`"
            )


def prepare_optimizer(optimizer, model) -> None:
    """Build ``optimizer`` on the model's trainable variables, or check it was built for them."""
    if optimizer.built:
        if not _tf_internals.optimizer_variables_known(optimizer, model.trainable_variables):
            raise ValueError(
                "optimizer was built for other variables than this model's trainable variables; pass a fresh optimizer"
            )
    else:
        optimizer.build(model.trainable_variables)
