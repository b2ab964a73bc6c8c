"""Scaled dot-product attention that stays finite, and the attention block of ParameterNet.

:func:`scaled_dot_product_attention` is the function; :class:`AttentionBlock` is the
Keras layer (multi-head self-attention, residual connection, optional layer
normalisation) that :class:`companion.book.models.ParameterNet` reads its input with. Both
take ``scaled=False`` for the unscaled form of case A's model, so a chapter can compare.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from companion._checks import as_float_tensor as _as_float_tensor
from companion._checks import check_int, is_half

__all__ = ["AttentionBlock", "scaled_dot_product_attention"]



def scaled_dot_product_attention(
    query,
    key,
    value,
    mask=None,
    *,
    scaled: bool = True,
    return_weights: bool = False,
):
    r"""Attention ``softmax(q k^T / sqrt(d_k)) v``, finite for masked rows and in half precision.

    .. code-block:: none

        scores  = q k^T / sqrt(d_k)            (q k^T if scaled=False)
        weights = softmax(scores over the keys), masked keys get weight 0
        output  = weights v

    **What the scaling is for.** With ``d_k``-dimensional queries and keys of unit
    variance, ``q . k`` has standard deviation ``sqrt(d_k)``. Unscaled, the softmax
    saturates as ``d_k`` grows: one weight near 1, the others near 0, and gradients that
    vanish. Saturation makes gradients *small*, not NaN: TensorFlow's softmax subtracts
    the row maximum and is finite for any finite scores. Scaling does not fix a NaN
    that comes from elsewhere (case A's comes from the power at 0). In float16 it also
    keeps ``q . k`` away from overflow, which is why the query is scaled *before* the
    product, as in Keras' ``MultiHeadAttention``.

    **Masking.** ``mask`` is True where a query may attend to a key. Masked scores are
    *replaced* (``tf.where``) by the most negative finite number of the dtype the
    softmax runs in, not added to ``-1e9``: ``-1e9`` is ``-inf`` in float16, and a row
    of ``-inf`` gives ``-inf - (-inf) = NaN`` in the softmax; an additive mask can also
    overflow to ``-inf`` on its own (``-max + score``). A row with *no* key to attend
    to gets weights 0 and output 0, rather than the NaN of ``0 / 0`` or the uniform
    average of values it was not allowed to see; its gradients are 0.

    **Half precision.** For float16 and bfloat16 inputs the products are computed in
    the input dtype and the softmax in float32 (its sum over keys needs the precision),
    so masked scores are filled with float32's finite minimum; weights and output are
    cast back to the input dtype.

    Args:
        query: tensor ``(..., n_q, d_k)``, float16, bfloat16, float32 or float64.
        key: tensor ``(..., n_k, d_k)``, same dtype.
        value: tensor ``(..., n_k, d_v)``, same dtype.
        mask: optional boolean tensor broadcastable to ``(..., n_q, n_k)``; True where
            the query may attend to the key.
        scaled: divide the scores by ``sqrt(d_k)`` (True) or not (case A's seed model).
        return_weights: also return the attention weights.

    Returns:
        The output ``(..., n_q, d_v)`` in the input dtype, and, with ``return_weights``,
        the weights ``(..., n_q, n_k)`` too.

    Raises:
        TypeError: if an input is not floating point, the dtypes differ, or ``mask`` is
            not boolean.
        ValueError: if the last dimensions of ``query`` and ``key`` differ.

    Example:
        >>> q, k = tf.ones([1, 2, 4]), tf.ones([1, 3, 4])
        >>> v = tf.reshape(tf.range(6.0), [1, 3, 2])
        >>> mask = tf.constant([[[True, False, True], [False, False, False]]])
        >>> scaled_dot_product_attention(q, k, v, mask).numpy()  # row 2 sees nothing
        array([[[2., 3.],
                [0., 0.]]], dtype=float32)
    """
    query = _as_float_tensor(query, "query")
    key = _as_float_tensor(key, "key", dtype=query.dtype)
    value = _as_float_tensor(value, "value", dtype=query.dtype)
    d_k = query.shape[-1]
    if d_k is not None and key.shape[-1] is not None and d_k != key.shape[-1]:
        raise ValueError(
            f"query and key must have the same last dimension d_k, got query {query.shape} and key {key.shape}"
        )
    if mask is not None:
        mask = tf.convert_to_tensor(mask)
        if mask.dtype != tf.bool:
            raise TypeError(f"mask must be a boolean tensor (True = attend), got dtype {mask.dtype.name}")
    dtype = query.dtype
    if scaled:
        if d_k is not None:
            scale = tf.constant(1.0 / math.sqrt(d_k), dtype)  # not tf.cast: no float32 rounding
        else:
            scale = tf.math.rsqrt(tf.cast(tf.shape(query)[-1], dtype))
        query = query * scale
    scores = tf.matmul(query, key, transpose_b=True)
    softmax_dtype = tf.float32 if is_half(dtype) else dtype
    scores = tf.cast(scores, softmax_dtype)
    if mask is not None:
        scores = tf.where(mask, scores, tf.constant(softmax_dtype.min, softmax_dtype))
    weights = tf.nn.softmax(scores, axis=-1)
    if mask is not None:
        attends = tf.reduce_any(mask, axis=-1, keepdims=True)
        weights = tf.where(attends, weights, tf.zeros_like(weights))
    weights = tf.cast(weights, dtype)
    output = tf.matmul(weights, value)
    return (output, weights) if return_weights else output


@keras.saving.register_keras_serializable(package="companion")
class AttentionBlock(keras.layers.Layer):
    """Multi-head self-attention with a residual connection and optional layer normalisation.

    .. code-block:: none

        heads_h = attention(x W_q[h], x W_k[h], x W_v[h])      h = 1..num_heads
        y       = x + concat_h(heads_h) W_o
        output  = LayerNorm(y)   (or y, with layer_norm=False)

    The block :class:`companion.book.models.ParameterNet` reads its sampled points with. The
    attention is :func:`scaled_dot_product_attention`, so masked points are handled
    without NaN and half precision works. Kernels use Glorot-normal initialisation and
    biases start at 0 (the seed answer's advice); ``layer_norm=True`` normalises the
    residual sum, which keeps the features at unit scale whatever the attention does.

    Args:
        num_heads: number of attention heads, >= 1.
        key_dim: size of each head's query, key and value, >= 1.
        scaled: scale the scores by ``1/sqrt(key_dim)``; ``False`` is case A's seed form.
        layer_norm: apply :class:`keras.layers.LayerNormalization` after the residual sum.
        epsilon: the layer normalisation's epsilon.
        kernel_initializer: initializer of the four kernels; each kernel gets its own
            copy (a seeded initializer's seed is offset per kernel), so the query, key
            and value kernels start different.
        **kwargs: base layer arguments (``name``, ``dtype``, ...).

    Call arguments:
        inputs: tensor ``(batch, n, d_model)``.
        mask: optional boolean tensor ``(batch, n)``, True for the points to attend to.

    Returns:
        A tensor of the shape of ``inputs``. Padding points (``mask`` False) are not
        attended to; an example whose points are all masked gets the residual only.

    Example:
        >>> block = AttentionBlock(num_heads=2, key_dim=4)
        >>> block(tf.zeros([3, 5, 8])).shape
        TensorShape([3, 5, 8])
    """

    def __init__(
        self,
        num_heads: int = 2,
        key_dim: int = 8,
        *,
        scaled: bool = True,
        layer_norm: bool = True,
        epsilon: float = 1e-6,
        kernel_initializer="glorot_normal",
        **kwargs,
    ):
        super().__init__(**kwargs)
        for label, number in (("num_heads", num_heads), ("key_dim", key_dim)):
            check_int(label, number, 1)
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.scaled = bool(scaled)
        self.layer_norm = bool(layer_norm)
        self.epsilon = float(epsilon)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.supports_masking = True
        self.norm = None
        if self.layer_norm:
            self.norm = keras.layers.LayerNormalization(epsilon=self.epsilon, dtype=self.dtype_policy, name="norm")

    def _kernel_initializer_for(self, index: int):
        """A fresh copy of ``kernel_initializer`` for kernel ``index`` (0-3: query, key, value, output).

        In Keras 3 an initializer instance is stateless: called twice with the same
        shape, it returns the same values (an unseeded one draws its seed once, when it
        is made). Passing one instance to the four kernels would start the query, key
        and value kernels identical, so every head would start with ``q = k = v`` up to
        the biases. Keras' ``MultiHeadAttention`` clones the initializer per sub-layer
        for this reason; an unseeded clone draws a new seed. A clone of a seeded
        initializer would draw the same values again, so its seed is offset by
        ``index``: still reproducible, and different per kernel.
        """
        initializer = self.kernel_initializer
        if not isinstance(initializer, keras.initializers.Initializer):
            return initializer  # a plain callable: the user's own
        config = initializer.get_config()
        seed = config.get("seed")
        if isinstance(seed, int) and not isinstance(seed, bool):
            config["seed"] = seed + index
        return initializer.__class__.from_config(config)

    def build(self, input_shape):
        if len(input_shape) != 3 or input_shape[-1] is None:
            raise ValueError(f"AttentionBlock expects inputs of shape (batch, n, d_model), got {tuple(input_shape)}")
        d_model = int(input_shape[-1])
        projection = (d_model, self.num_heads, self.key_dim)
        self.query_kernel = self.add_weight(
            name="query_kernel", shape=projection, initializer=self._kernel_initializer_for(0)
        )
        self.key_kernel = self.add_weight(name="key_kernel", shape=projection, initializer=self._kernel_initializer_for(1))
        self.value_kernel = self.add_weight(
            name="value_kernel", shape=projection, initializer=self._kernel_initializer_for(2)
        )
        bias_shape = (self.num_heads, self.key_dim)
        self.query_bias = self.add_weight(name="query_bias", shape=bias_shape, initializer="zeros")
        self.key_bias = self.add_weight(name="key_bias", shape=bias_shape, initializer="zeros")
        self.value_bias = self.add_weight(name="value_bias", shape=bias_shape, initializer="zeros")
        self.output_kernel = self.add_weight(
            name="output_kernel",
            shape=(self.num_heads, self.key_dim, d_model),
            initializer=self._kernel_initializer_for(3),
        )
        self.output_bias = self.add_weight(name="output_bias", shape=(d_model,), initializer="zeros")
        if self.norm is not None:
            self.norm.build(input_shape)

    def project(self, inputs):
        """The per-head query, key and value of ``inputs``: ``x W + b`` for each of the three.

        Args:
            inputs: tensor ``(batch, n, d_model)``; the block must be built.

        Returns:
            A tuple ``(query, key, value)`` of tensors ``(batch, num_heads, n, key_dim)``.
        """
        # (batch, n, d_model) x (d_model, heads, key_dim) -> (batch, heads, n, key_dim)
        query = tf.einsum("bnd,dhk->bhnk", inputs, self.query_kernel) + self.query_bias[:, None, :]
        key = tf.einsum("bnd,dhk->bhnk", inputs, self.key_kernel) + self.key_bias[:, None, :]
        value = tf.einsum("bnd,dhk->bhnk", inputs, self.value_kernel) + self.value_bias[:, None, :]
        return query, key, value

    def attention_weights(self, inputs, mask=None):
        """The attention weights the block computes for ``inputs``, ``(batch, num_heads, n, n)``.

        Args:
            inputs: tensor ``(batch, n, d_model)``; the block must be built.
            mask: optional boolean tensor ``(batch, n)``, True for the points to attend to.

        Returns:
            The softmax weights of every head, rows summing to 1 (0 for rows that see nothing).
        """
        query, key, value = self.project(inputs)
        attention_mask = None if mask is None else tf.cast(mask, tf.bool)[:, None, None, :]
        _, weights = scaled_dot_product_attention(
            query, key, value, attention_mask, scaled=self.scaled, return_weights=True
        )
        return weights

    def call(self, inputs, mask=None):
        query, key, value = self.project(inputs)
        attention_mask = None
        if mask is not None:
            attention_mask = tf.cast(mask, tf.bool)[:, None, None, :]  # (batch, 1, 1, n): keys
        heads = scaled_dot_product_attention(query, key, value, attention_mask, scaled=self.scaled)
        output = tf.einsum("bhnk,hkd->bnd", heads, self.output_kernel) + self.output_bias
        output = inputs + output
        if self.norm is not None:
            output = self.norm(output)
        return output

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def compute_mask(self, inputs, mask=None):
        return mask

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "key_dim": self.key_dim,
                "scaled": self.scaled,
                "layer_norm": self.layer_norm,
                "epsilon": self.epsilon,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            }
        )
        return config
