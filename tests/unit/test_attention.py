"""companion.attention: finite attention for masked rows and half precision; the Keras block."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import keras
from companion.attention import AttentionBlock, scaled_dot_product_attention
from companion.book.reproductions import seed_scaled_dot_product_attention


def _reference(q, k, v, mask=None, scaled=True):
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    scores = q @ np.swapaxes(k, -1, -2)
    if scaled:
        scores /= np.sqrt(q.shape[-1])
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return weights @ v, weights


def _random(shape, seed, dtype=tf.float32):
    return tf.cast(tf.random.stateless_normal(shape, seed=[seed, 0]), dtype)


@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "unscaled"])
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64], ids=lambda d: d.name)
def test_attention_matches_the_softmax_formula(scaled, dtype):
    q, k, v = _random([2, 3, 4, 8], 1, dtype), _random([2, 3, 5, 8], 2, dtype), _random([2, 3, 5, 6], 3, dtype)
    mask = np.random.default_rng(0).random((2, 1, 4, 5)) > 0.3
    mask[..., 0] = True  # every row attends to something
    out, weights = scaled_dot_product_attention(q, k, v, mask, scaled=scaled, return_weights=True)
    expected_out, expected_weights = _reference(q, k, v, mask, scaled)
    rtol = 1e-5 if dtype == tf.float32 else 1e-12
    np.testing.assert_allclose(out.numpy(), expected_out, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(weights.numpy(), expected_weights, rtol=rtol, atol=rtol)
    assert out.dtype == dtype


def test_seed_attention_is_the_same_for_float32_but_rejects_half_precision():
    q, k, v = _random([2, 4, 8], 4), _random([2, 5, 8], 5), _random([2, 5, 3], 6)
    np.testing.assert_allclose(
        seed_scaled_dot_product_attention(q, k, v).numpy(), scaled_dot_product_attention(q, k, v).numpy(), rtol=1e-6
    )
    with pytest.raises(TypeError, match="same dtype"):
        seed_scaled_dot_product_attention(tf.cast(q, tf.float16), tf.cast(k, tf.float16), tf.cast(v, tf.float16))


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32, tf.float64], ids=lambda d: d.name)
def test_fully_masked_row_gives_zero_output_and_finite_gradients(dtype):
    q, k, v = _random([1, 3, 4], 7, dtype), _random([1, 5, 4], 8, dtype), _random([1, 5, 2], 9, dtype)
    mask = tf.constant([[[True, True, False, False, False], [False] * 5, [True] * 5]])
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        out, weights = scaled_dot_product_attention(q, k, v, mask, return_weights=True)
        loss = tf.reduce_sum(tf.cast(out, tf.float32) ** 2)
    grads = tape.gradient(loss, [q, k, v])
    assert out.dtype == dtype
    np.testing.assert_array_equal(tf.cast(out[0, 1], tf.float32).numpy(), 0.0)
    np.testing.assert_array_equal(tf.cast(weights[0, 1], tf.float32).numpy(), 0.0)
    for gradient in grads:
        assert np.all(np.isfinite(tf.cast(gradient, tf.float32).numpy()))
    # The masked keys get no weight anywhere.
    np.testing.assert_array_equal(tf.cast(weights[0, 0, 2:], tf.float32).numpy(), 0.0)


def test_additive_minus_1e9_mask_breaks_float16_where_the_fill_does_not():
    scores = tf.constant([[-1.0, 2.0, 3.0]], tf.float16)
    mask = tf.constant([[False, False, False]])
    additive = tf.nn.softmax(scores + (1.0 - tf.cast(mask, tf.float16)) * tf.constant(-1e9, tf.float16))
    assert not np.all(np.isfinite(additive.numpy()))  # -1e9 is -inf in float16: -inf - -inf = NaN
    q = tf.constant([[[1.0]]], tf.float16)
    k = tf.constant([[[-1.0], [2.0], [3.0]]], tf.float16)
    out = scaled_dot_product_attention(q, k, tf.ones([1, 3, 2], tf.float16), mask[None])
    assert np.all(np.isfinite(out.numpy().astype(np.float32)))


@given(
    scores=hnp.arrays(np.float32, (3, 6), elements=st.floats(width=32, allow_nan=False, allow_infinity=False)),
    mask=hnp.arrays(np.bool_, (3, 6)),
)
def test_attention_is_finite_for_any_finite_scores_and_mask(scores, mask):
    # With d_k = 1 and keys of +-1 the scores are +-the queries: any finite float32 value.
    qs = tf.reshape(tf.constant(scores), [3, 6, 1])
    ks = tf.constant(np.sign(np.arange(1, 7) - 3.5).astype(np.float32).reshape(1, 6, 1).repeat(3, 0))
    v = tf.reshape(tf.range(3 * 6 * 2, dtype=tf.float32), [3, 6, 2]) / 36.0
    with tf.GradientTape() as tape:
        tape.watch([qs, v])
        out, weights = scaled_dot_product_attention(qs, ks, v, mask[:, None, :], return_weights=True)
    grads = tape.gradient(out, [qs, v])
    assert np.all(np.isfinite(out.numpy())) and np.all(np.isfinite(weights.numpy()))
    assert all(np.all(np.isfinite(g.numpy())) for g in grads)
    row_sums = weights.numpy().sum(axis=-1)[:, 0]
    np.testing.assert_allclose(row_sums, mask.any(axis=-1).astype(np.float32), atol=1e-5)


def test_scaling_keeps_the_softmax_from_saturating():
    # What the scaling fixes: with d_k = 64 the unscaled scores have std 8, and the
    # weights collapse onto one key; scaled, they stay spread out.
    q, k, v = _random([1, 32, 64], 10), _random([1, 32, 64], 11), _random([1, 32, 4], 12)
    _, scaled = scaled_dot_product_attention(q, k, v, return_weights=True)
    _, unscaled = scaled_dot_product_attention(q, k, v, scaled=False, return_weights=True)
    assert float(tf.reduce_mean(tf.reduce_max(unscaled, -1))) > 0.7
    assert float(tf.reduce_mean(tf.reduce_max(scaled, -1))) < 0.5


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"query": tf.ones([1, 2, 3], tf.int32)}, TypeError, "floating dtype"),
        ({"key": tf.ones([1, 2, 3], tf.float64)}, TypeError, "key must have dtype float32"),
        ({"key": tf.ones([1, 2, 4])}, ValueError, "same last dimension"),
        ({"mask": tf.ones([1, 2, 2])}, TypeError, "mask must be a boolean"),
    ],
)
def test_attention_errors_say_what_was_given(kwargs, error, message):
    arguments = {"query": tf.ones([1, 2, 3]), "key": tf.ones([1, 2, 3]), "value": tf.ones([1, 2, 5]), **kwargs}
    with pytest.raises(error, match=message):
        scaled_dot_product_attention(**arguments)


# --- AttentionBlock --------------------------------------------------------------------


def test_attention_block_config_round_trips_and_saves(tmp_path):
    block = AttentionBlock(num_heads=2, key_dim=4, scaled=False, layer_norm=False, name="block")
    inputs = keras.Input((5, 8))
    model = keras.Model(inputs, block(inputs))
    x = _random([3, 5, 8], 13)
    config = block.get_config()
    clone = AttentionBlock.from_config(config)
    assert clone.get_config() == config and not clone.scaled and not clone.layer_norm
    path = tmp_path / "block.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(loaded(x).numpy(), model(x).numpy())


def test_attention_block_ignores_masked_points():
    block = AttentionBlock(num_heads=2, key_dim=4)
    x = _random([2, 6, 8], 14)
    mask = tf.constant([[True] * 4 + [False] * 2] * 2)
    noise = tf.concat([tf.zeros([2, 4, 8]), 100.0 * _random([2, 2, 8], 15)], axis=1)
    first = block(x, mask=mask)
    second = block(x + noise, mask=mask)
    np.testing.assert_allclose(second.numpy()[:, :4], first.numpy()[:, :4], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_attention_block_works_in_mixed_precision(policy):
    block = AttentionBlock(num_heads=2, key_dim=4, dtype=policy)
    x = 50.0 * _random([2, 6, 8], 16)
    mask = tf.constant([[True] * 6, [False] * 6])  # the second example attends to nothing
    with tf.GradientTape() as tape:
        out = block(x, mask=mask)
        loss = tf.reduce_sum(tf.cast(out, tf.float32) ** 2)
    grads = tape.gradient(loss, block.trainable_variables)
    assert out.dtype == tf.as_dtype(policy.split("_")[1])
    assert np.all(np.isfinite(tf.cast(out, tf.float32).numpy()))
    assert all(np.all(np.isfinite(g.numpy())) for g in grads)


@pytest.mark.parametrize(
    "initializer",
    ["glorot_normal", keras.initializers.GlorotNormal(seed=7), keras.initializers.RandomUniform(seed=3)],
    ids=["by-name", "seeded-glorot", "seeded-uniform"],
)
def test_attention_block_kernels_start_different(initializer):
    # Keras 3 initializers are stateless: one instance called twice gives the same values.
    # Shared by the four kernels, it would start query, key and value kernels identical.
    keras.utils.set_random_seed(0)
    block = AttentionBlock(num_heads=2, key_dim=4, kernel_initializer=initializer)
    block.build((None, 5, 8))
    kernels = [block.query_kernel, block.key_kernel, block.value_kernel]
    for i in range(3):
        for j in range(i + 1, 3):
            assert not np.allclose(kernels[i].numpy(), kernels[j].numpy())
    assert not np.allclose(block.output_kernel.numpy().reshape(-1), block.query_kernel.numpy().reshape(-1))
    # ...each still drawn from the initializer's distribution: Glorot for a (8, 2, 4)
    # kernel has fan_in = 2 * 8, fan_out = 4 * 8 (Keras' receptive field), sd sqrt(2 / 48)
    if "glorot" in str(initializer).lower():
        for kernel in kernels:
            assert 0.15 < np.std(kernel.numpy()) < 0.26


def test_attention_block_seeded_initializer_is_reproducible():
    def kernels():
        block = AttentionBlock(num_heads=2, key_dim=4, kernel_initializer=keras.initializers.GlorotNormal(seed=7))
        block.build((None, 5, 8))
        return [w.numpy() for w in (block.query_kernel, block.key_kernel, block.value_kernel, block.output_kernel)]

    for first, second in zip(kernels(), kernels()):
        np.testing.assert_array_equal(first, second)


def test_attention_block_project_and_weights_match_the_call():
    keras.utils.set_random_seed(0)
    block = AttentionBlock(num_heads=2, key_dim=4, layer_norm=False)
    x = _random([3, 5, 8], 11)
    mask = tf.constant([[True] * 5, [True, True, False, False, False], [True] * 5])
    output = block(x, mask=mask)
    q, k, v = block.project(x)
    weights = block.attention_weights(x, mask=mask)
    heads = tf.matmul(weights, v)
    expected = x + tf.einsum("bhnk,hkd->bnd", heads, block.output_kernel) + block.output_bias
    np.testing.assert_allclose(output.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)
    assert q.shape == (3, 2, 5, 4)
    np.testing.assert_allclose(weights.numpy().sum(-1), 1.0, rtol=1e-6)
    assert np.all(weights.numpy()[1, :, :, 2:] == 0)  # masked keys get weight 0


def test_attention_block_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        AttentionBlock(num_heads=0)
    with pytest.raises(TypeError, match="key_dim must be an int"):
        AttentionBlock(key_dim=2.5)
    with pytest.raises(ValueError, match=r"\(batch, n, d_model\)"):
        AttentionBlock()(tf.ones([2, 3]))


def test_docstring_examples_run():
    import doctest

    from companion import attention

    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(attention, globs={**vars(attention), "tf": tf, "np": np}):
        runner.run(test)
    assert runner.failures == 0 and runner.tries >= 2
