"""Input checks of :func:`companion.training.train`: every error a caller can cause is
raised here, before any step runs, with a message that says what was given and what is
expected.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import keras
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


def as_dataset(dataset) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of ``(inputs, targets)`` with a known, finite cardinality."""
    if isinstance(dataset, tf.data.Dataset):
        spec = dataset.element_spec
        if not (isinstance(spec, (tuple, list)) and len(spec) == 2):
            extra = ""
            if isinstance(spec, (tuple, list)) and len(spec) == 3:
                extra = " (sample weights are not supported: fold them into the loss)"
            raise TypeError(
                f"dataset must yield (inputs, targets) pairs, but its elements are {_describe_spec(spec)}{extra}; "
                "e.g. tf.data.Dataset.from_tensor_slices((x, y)).batch(32)"
            )
        cardinality = int(dataset.cardinality())
        if cardinality == 0:
            raise ValueError("dataset is empty: it yields no batch")
        if cardinality == tf.data.INFINITE_CARDINALITY:
            raise ValueError(
                "dataset is infinite (e.g. .repeat() without a count), so an epoch would never end; "
                "use .take(steps_per_epoch) or .repeat(n)"
            )
        return dataset
    if isinstance(dataset, (str, bytes, dict)) or not isinstance(dataset, Iterable):
        raise TypeError(
            "dataset must be a tf.data.Dataset or an iterable of (inputs, targets) batches, "
            f"got {type(dataset).__name__}"
        )
    batches = []
    for index, element in enumerate(dataset):
        if not (isinstance(element, (tuple, list)) and len(element) == 2):
            described = type(element).__name__
            if isinstance(element, (tuple, list)):
                described += f" of length {len(element)}"
            raise TypeError(f"dataset must yield (inputs, targets) pairs, but element {index} is a {described}")
        try:
            batches.append(tf.nest.map_structure(tf.convert_to_tensor, tuple(element)))
        except (TypeError, ValueError) as err:
            raise TypeError(f"element {index} of dataset cannot be converted to tensors: {err}") from None
    if not batches:
        raise ValueError("dataset is empty: it yields no batch")
    spec = tf.nest.map_structure(tf.type_spec_from_value, batches[0])
    for index, batch in enumerate(batches[1:], start=1):
        try:
            tf.nest.assert_same_structure(batches[0], batch)
            spec = tf.nest.map_structure(
                lambda s, t: s.most_specific_common_supertype([tf.type_spec_from_value(t)]), spec, batch
            )
        except (TypeError, ValueError) as err:
            raise TypeError(f"element {index} of dataset does not have the structure of element 0: {err}") from None
        if any(s is None for s in tf.nest.flatten(spec)):
            raise TypeError(f"element {index} of dataset has a different dtype from element 0")
    result = tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=spec)
    return result.apply(tf.data.experimental.assert_cardinality(len(batches)))


def check_arguments(
    model, loss, optimizer, *, epochs, strategy, jit_compile, clip_global_norm, on_nonfinite,
    max_consecutive_nonfinite, checkpoint_dir, verbose,
) -> dict[str, Any]:
    """The arguments of ``train`` checked and normalised (loss resolved, numbers as Python types)."""
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"model must be a Keras model (keras.Model or keras.layers.Layer), got {type(model).__name__}")
    loss = resolve_loss(loss)
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
