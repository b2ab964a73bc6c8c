"""The doctor on a public mixed-precision report (issue 42, item 6): a layer with sublayers.

A layer's dtype policy is its own: the ``Conv1D`` a block creates takes the global
``mixed_float16`` policy and hands float16 values to the block's own ops, whatever the
block's policy. The float32 remedy is therefore checked with every nested layer in
float32, printed with the sublayers named, and every layer's policy is put back.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from companion.book import field
from companion.book.field import field_rebuild
from companion.diagnostics import diagnose

HERE = __file__
FIELD = field.__file__  # where the rebuilt critic's lines are


def line_of(marker: str, path: str = HERE) -> int:
    """The line of ``path`` (by default this file) that ends with ``# <marker>``."""
    lines = open(path).read().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if line.rstrip().endswith(f"# {marker}"))


@pytest.fixture(autouse=True)
def float32_policy():
    yield
    keras.mixed_precision.set_global_policy("float32")


def _critic(fixed=False):
    # The rebuild puts the global policy back after building; the reporter's script keeps
    # mixed_float16 while it trains, so set it again (the autouse fixture resets it).
    rebuild = field_rebuild("wgan_critic", fixed=fixed)  # seeds Keras with 0 first
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = rebuild.data
    return rebuild.model, x, y


def test_a_float16_sublayer_inside_a_block_is_put_in_float32_for_the_check_and_named_in_the_remedy():
    """tensorflow/tensorflow#47156 (https://github.com/tensorflow/tensorflow/issues/47156).

    A WGAN-GP critic under ``mixed_float16`` with instance normalisation: its variance
    overflows float16 (the reporter: "the variance overflows quickly"). The block's own
    ``Square`` overflows on the float16 output of its ``Conv1D``; the block alone in
    float32 does not cure it (the convolution still computes in float16), the block and
    the layer it creates in float32 do.
    """
    model, x, y = _critic()
    policies = {layer.path: layer.dtype_policy.name for layer in model._flatten_layers(include_self=False)}
    d = diagnose(model, (x, y), batch_size=8)
    assert (d.phase, d.op, d.cause, d.layer, d.dtype) == ("forward", "Square", "overflow", "critic/block",
                                                          "float16"), str(d)
    assert d.source == f"{FIELD}:{line_of('instance-var', FIELD)}"
    assert d.remedy.startswith('compute critic/block in float32: ResBlock(..., dtype="float32"), and '
                               'dtype="float32" for each layer it creates (critic/block/conv'), d.remedy
    assert d.verified.startswith("verified: the step is finite with critic/block's dtype policy float32 and "
                                 "that of the 1 layer nested in it (critic/block/conv)"), d.verified
    after = {layer.path: layer.dtype_policy.name for layer in model._flatten_layers(include_self=False)}
    assert after == policies and after["critic/block/conv"] == "mixed_float16"
    model, x, y = _critic(fixed=True)  # the remedy, as printed: the block and its conv in float32
    history = model.fit(x, y, epochs=2, batch_size=8, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"]).all()


@pytest.mark.skipif(
    tuple(int(p) for p in keras.__version__.split(".")[:2]) < (3, 6),
    reason="Keras 3.5's MultiHeadAttention does not pass its dtype policy on (a known gap, issue 42)",
)
def test_a_keras_composite_layer_passes_its_float32_policy_on_by_itself():
    """A Keras layer that makes its own sublayers (``MultiHeadAttention``) passes ``dtype`` on.

    The remedy is then the layer's ``dtype="float32"`` alone, checked with its sublayers
    in float32 as the constructor would make them.
    """
    def build(fixed):
        keras.mixed_precision.set_global_policy("mixed_float16")
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4, 8))
        attention = keras.layers.MultiHeadAttention(2, 8, name="mha", dtype="float32" if fixed else None)
        hidden = attention(inputs, inputs)
        outputs = keras.layers.Dense(1, dtype="float32", name="head")(keras.layers.GlobalAveragePooling1D()(hidden))
        model = keras.Model(inputs, outputs, name="net")
        model.compile(optimizer="sgd", loss="mse")
        return model, (np.random.default_rng(0).normal(size=(8, 4, 8)) * 300).astype("float32"), np.ones((8, 1))

    model, x, y = build(False)
    d = diagnose(model, (x, y), batch_size=8)
    assert d.cause == "overflow" and d.layer == "mha" and d.dtype == "float16", str(d)
    assert d.remedy.startswith('compute mha in float32: MultiHeadAttention(..., dtype="float32") (its'), d.remedy
    assert d.verified.startswith("verified:") and "nested in it" in d.verified, d.verified
    assert model.get_layer("mha")._query_dense.dtype_policy.name == "mixed_float16"
    model, x, y = build(True)
    history = model.fit(x, y, epochs=2, batch_size=8, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"]).all()
