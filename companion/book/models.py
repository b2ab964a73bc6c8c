"""ParameterNet, case A's model, with switchable fixes.

:class:`ParameterNet` reads a sampled function ``(xs, ys)`` with multi-head attention,
predicts the parameters ``(a, b, c, d)`` of ``K`` basis terms built from the seed
question's four transforms, and returns the fitted function at ``xs``. With ``fixes=()``
it is the question's model, which gets NaN gradients at a finite loss; each fix can be
switched on alone, so a chapter can measure what each one does.
"""

from __future__ import annotations

from typing import Iterable

import keras
import tensorflow as tf

from companion.attention import AttentionBlock
from companion.numerics import bounded, bounded_inverse, log_exp_pow, safe_pow, signed_pow
from companion._checks import check_int, is_half

__all__ = ["FIXES", "FIX_NAMES", "BasisPower", "ParameterNet"]

#: Every fix, in the order they are applied; ``ParameterNet``'s default turns all on.
FIXES: tuple[str, ...] = ("safe_power", "signed_power", "bounded_exponents", "scaled_attention", "layer_norm")
#: The names ``fixes`` accepts: :data:`FIXES` and the seed answer's own power, which
#: is not on by default (the book measures its costs).
FIX_NAMES: tuple[str, ...] = (*FIXES, "log_exp_power")



def _check_fixes(fixes) -> tuple[str, ...]:
    if isinstance(fixes, (str, bytes)):
        raise TypeError(f"fixes must be a collection of fix names such as ('safe_power',), got the string {fixes!r}")
    try:
        names = list(fixes)
    except TypeError:
        raise TypeError(f"fixes must be a collection of fix names, got {type(fixes).__name__}") from None
    for name in names:
        if not isinstance(name, str) or name not in FIX_NAMES:
            raise ValueError(f"unknown fix {name!r}; valid fixes: {', '.join(FIX_NAMES)}")
    if "log_exp_power" in names and {"safe_power", "signed_power"} & set(names):
        raise ValueError(
            "'log_exp_power' is another way to compute the powers: use it instead of "
            f"'safe_power'/'signed_power', not with them (got {tuple(names)})"
        )
    return tuple(name for name in FIX_NAMES if name in names)


def _check_range(label: str, value, needs_one: bool) -> tuple[float, float]:
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise TypeError(f"{label} must be a pair of numbers (low, high), got {value!r}") from None
    if not low < high:
        raise ValueError(f"{label} must have low < high, got {value!r}")
    if needs_one and not low < 1.0 < high:
        raise ValueError(f"{label} must contain 1 strictly inside, where the exponents start, got {value!r}")
    return low, high


def _check_positive_int(label: str, value) -> int:
    return check_int(label, value, 1)


@keras.saving.register_keras_serializable(package="companion")
class ParameterNet(keras.Model):
    r"""Fit a 1-D function with basis terms whose parameters an attention network predicts.

    Case A's model. Called as ``model((xs, ys))`` on a function sampled at ``n`` points,
    it predicts, for each function in the batch, the parameters of ``K`` terms built from
    the seed question's four transforms ``x -> a x``, ``x -> x^b``, ``f -> f^c`` and
    ``f -> d f``, and returns their sum at ``xs``:

    .. code-block:: none

        term_k(x) = d_k * pow(pow(a_k * x, b_k), c_k)          k = 1..K
        g_hat(x)  = sum_k term_k(x)

    The order of the transforms is the question's: scale the input, raise it to ``b``,
    raise the result to ``c``, scale the output. For ``a x >= 0`` a term is
    ``d a^(bc) x^(bc)``: ``b`` and ``c`` only matter through their product, and ``a``
    only through ``d a^(bc)``. The parametrisation is over-complete on purpose: it is
    the question's, and its failure (two powers in a row, each with an infinite
    derivative at 0 once its exponent drops below 1) is the book's subject. One
    consequence worth knowing: the gradients with respect to ``b`` and ``c`` are equal
    whenever ``b = c``, and both start at 1 through identical transforms, so with the
    default ranges ``b`` and ``c`` stay close (equal to within a relative 1e-6, not
    bit-identical) all through training and the effective exponent is about ``b^2``. Different ``b_range`` and ``c_range`` break the
    tie.

    **Architecture.** Each point ``(x_i, y_i)`` is embedded by a dense layer to
    ``d_model`` features; an :class:`~companion.attention.AttentionBlock`
    (``num_heads`` heads, residual connection) lets every point see the others; the mean
    over points goes through a dense layer (GELU), and two dense heads give the raw
    parameters: ``(a, d)`` from a head with small random initial weights, ``(b, c)``
    from a head whose weights start at zero. Then

    .. code-block:: none

        a = 1 + raw_a        d = 1/K + raw_d
        b = 1 + raw_b        c = 1 + raw_c                              (fixes=())
        b = bounded(raw_b + bounded_inverse(1, *b_range), *b_range)
                                                        ("bounded_exponents")

    so at initialisation ``b = c = 1`` (to rounding) for every input (each term is linear,
    and the terms differ through ``a`` and ``d``, which breaks their symmetry), and
    ``a`` and ``d`` start near 1 and ``1/K`` (the fit starts near ``g_hat(x) = x``).
    The basis is evaluated in float32 when the model computes in float16/bfloat16.

    **The seed's model** (``fixes=()``) fails as the question says. Built after
    ``keras.utils.set_random_seed(0)`` with the defaults and trained with plain Adam
    (learning rate 1e-2) on ``companion.book.targets.dataset("power_law", 8, 16, 32)``, its
    loss falls from 1.07 to 0.19 in 8 steps, and at step 8 (0-based), with a finite
    loss, the gradients of every weight are NaN: four (function, term) pairs' ``b = c``
    have dropped to 0.992, and at ``x = 0`` the base-side derivative of ``tf.pow`` is inf, times the 0
    of ``d(a x)/da``. (On the ``"sqrt"`` family it fails at step 1, at any learning
    rate: one Adam step moves ``b`` below 1.)

    **Fixes** (``fixes``, any subset of :data:`FIX_NAMES`; default: all of :data:`FIXES`):

    - ``"safe_power"``: the powers use :func:`~companion.numerics.safe_pow` instead of
      ``tf.pow``: 0 for a base <= 0 and finite gradients at 0. This is the fix for the
      NaN of case A.
    - ``"signed_power"``: the powers use :func:`~companion.numerics.signed_pow`, the odd
      extension ``sign(u) |u|^p``, for inputs that can be negative (it also covers what
      ``"safe_power"`` does at 0, and takes precedence over it).
    - ``"bounded_exponents"``: ``b`` and ``c`` go through a sigmoid into ``b_range`` and
      ``c_range`` (the answer's [0.1, 2]). It keeps them finite; alone it does not
      prevent the NaN, since [0.1, 2] contains exponents below 1.
    - ``"scaled_attention"``: scores scaled by ``1/sqrt(key_dim)``; alone it does not
      prevent the NaN either.
    - ``"layer_norm"``: layer normalisation after the attention's residual sum.
    - ``"log_exp_power"`` (not in the default): the answer's
      ``exp(p log(max(u, eps)))``, :func:`~companion.numerics.log_exp_pow`, instead of
      ``tf.pow``; exclusive with the two power fixes above.

    Args:
        num_terms: ``K``, the number of basis terms, >= 1.
        d_model: width of the point embedding, >= 1.
        num_heads: attention heads, >= 1.
        key_dim: size of each head; default ``max(1, d_model // num_heads)``.
        fixes: the fixes to switch on (an iterable of names); ``()`` is the seed's model.
        b_range: ``(low, high)`` of ``b`` under ``"bounded_exponents"``; must contain 1.
        c_range: ``(low, high)`` of ``c`` under ``"bounded_exponents"``; must contain 1.
            A range reaching below 0, e.g. ``(-2.0, 2.0)``, lets the terms fit steep
            targets like ``1/sqrt(x)`` on (0, 1] (the powers then take negative
            exponents, and are 0, not inf, at a base of 0).
        log_exp_eps: the ``eps`` of ``"log_exp_power"``.
        **kwargs: base model arguments (``name``, ``dtype``, ...).

    Call arguments:
        inputs: a pair ``(xs, ys)`` of float tensors of shape ``(batch, n, 1)``.
        training: unused (no dropout), accepted for the Keras call convention.

    Returns:
        The fitted values at ``xs``, shape ``(batch, n, 1)``.

    Raises:
        TypeError, ValueError: for bad arguments; ``ValueError`` lists the valid fix
            names for an unknown one.

    Example:
        >>> from companion.book import targets
        >>> xs, ys = targets.sample("sqrt", batch_size=4, n=16, seed=0)
        >>> model = ParameterNet(num_terms=3, d_model=16, num_heads=2)
        >>> model((xs, ys)).shape
        TensorShape([4, 16, 1])
        >>> model.fixes == FIXES, model.power_name
        (True, 'signed_pow')
    """

    def __init__(
        self,
        num_terms: int = 3,
        d_model: int = 16,
        num_heads: int = 2,
        key_dim: int | None = None,
        *,
        fixes: Iterable[str] = FIXES,
        b_range: tuple[float, float] = (0.1, 2.0),
        c_range: tuple[float, float] = (0.1, 2.0),
        log_exp_eps: float = 1e-6,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_terms = _check_positive_int("num_terms", num_terms)
        self.d_model = _check_positive_int("d_model", d_model)
        self.num_heads = _check_positive_int("num_heads", num_heads)
        self.key_dim = _check_positive_int("key_dim", key_dim if key_dim is not None else max(1, d_model // num_heads))
        self.fixes = _check_fixes(fixes)
        bounded_on = "bounded_exponents" in self.fixes
        self.b_range = _check_range("b_range", b_range, bounded_on)
        self.c_range = _check_range("c_range", c_range, bounded_on)
        self.log_exp_eps = float(log_exp_eps)
        if not self.log_exp_eps > 0:
            raise ValueError(f"log_exp_eps must be > 0, got {log_exp_eps!r}")

        policy = self.dtype_policy
        self.embedding = keras.layers.Dense(
            d_model, kernel_initializer="glorot_normal", dtype=policy, name="embedding"
        )
        self.attention = AttentionBlock(
            self.num_heads,
            self.key_dim,
            scaled="scaled_attention" in self.fixes,
            layer_norm="layer_norm" in self.fixes,
            dtype=policy,
            name="attention",
        )
        self.hidden = keras.layers.Dense(
            d_model, activation="gelu", kernel_initializer="glorot_normal", dtype=policy, name="hidden"
        )
        self.scale_head = keras.layers.Dense(
            2 * self.num_terms,
            kernel_initializer=keras.initializers.RandomNormal(stddev=0.1 / d_model**0.5),
            dtype=policy,
            name="scale_head",
        )
        self.exponent_head = keras.layers.Dense(
            2 * self.num_terms, kernel_initializer="zeros", dtype=policy, name="exponent_head"
        )

    # --- what the fixes select ----------------------------------------------------------

    @property
    def power_name(self) -> str:
        """Name of the power function the basis uses (``"tf.pow"``, ``"safe_pow"``, ``"signed_pow"`` or ``"log_exp_pow"``)."""
        if "signed_power" in self.fixes:
            return "signed_pow"
        if "safe_power" in self.fixes:
            return "safe_pow"
        if "log_exp_power" in self.fixes:
            return "log_exp_pow"
        return "tf.pow"

    def _power(self, base, exponent):
        name = self.power_name
        if name == "signed_pow":
            return signed_pow(base, exponent)
        if name == "safe_pow":
            return safe_pow(base, exponent)
        if name == "log_exp_pow":
            return log_exp_pow(base, exponent, eps=self.log_exp_eps)
        return tf.pow(base, exponent)

    def _exponent(self, raw, value_range):
        if "bounded_exponents" in self.fixes:
            with tf.init_scope():  # a Python float, also when called inside a tf.function
                start = float(bounded_inverse(1.0, *value_range))
            return bounded(raw + start, *value_range)
        return 1.0 + raw

    # --- Keras ------------------------------------------------------------------------

    @staticmethod
    def _split_inputs(inputs):
        if not (isinstance(inputs, (tuple, list)) and len(inputs) == 2):
            raise TypeError(
                "ParameterNet is called on a pair (xs, ys) of tensors of shape (batch, n, 1), "
                f"got {type(inputs).__name__}" + (f" of length {len(inputs)}" if isinstance(inputs, (tuple, list)) else "")
            )
        xs, ys = inputs
        for label, tensor in (("xs", xs), ("ys", ys)):
            shape = tuple(tensor.shape)
            if len(shape) != 3 or shape[-1] not in (1, None):
                raise ValueError(f"{label} must have shape (batch, n, 1), got {shape}")
        return xs, ys

    def build(self, input_shape):
        is_pair = isinstance(input_shape, (tuple, list)) and len(input_shape) == 2
        if not (is_pair and all(isinstance(shape, (tuple, list, tf.TensorShape)) for shape in input_shape)):
            raise TypeError(
                "ParameterNet is called on a pair (xs, ys) of tensors of shape (batch, n, 1), "
                f"got a single input of shape {tuple(input_shape)}"
            )
        batch, n = tuple(input_shape[0])[:2]
        self.embedding.build((batch, n, 2))
        self.attention.build((batch, n, self.d_model))
        self.hidden.build((batch, self.d_model))
        self.scale_head.build((batch, self.d_model))
        self.exponent_head.build((batch, self.d_model))

    def _raw_parameters(self, xs, ys):
        dtype = self.compute_dtype
        points = tf.concat([tf.cast(xs, dtype), tf.cast(ys, dtype)], axis=-1)  # (batch, n, 2)
        features = self.attention(self.embedding(points))
        summary = self.hidden(tf.reduce_mean(features, axis=1))  # (batch, d_model)
        raw_a, raw_d = tf.split(self.scale_head(summary), 2, axis=-1)
        raw_b, raw_c = tf.split(self.exponent_head(summary), 2, axis=-1)
        return raw_a, raw_b, raw_c, raw_d

    def _basis_dtype(self):
        return tf.float32 if is_half(self.compute_dtype) else tf.as_dtype(self.compute_dtype)

    def predict_parameters(self, inputs) -> dict[str, tf.Tensor]:
        """The parameters ``a, b, c, d`` the model predicts for each function in ``inputs``.

        Args:
            inputs: a pair ``(xs, ys)`` of tensors ``(batch, n, 1)``.

        Returns:
            A dict with keys ``"a", "b", "c", "d"``, each a tensor ``(batch, K)`` in the
            basis dtype (float32 for half-precision models).
        """
        xs, ys = self._split_inputs(inputs)
        if not self.built:
            self.build((tuple(xs.shape), tuple(ys.shape)))
        dtype = self._basis_dtype()
        raw_a, raw_b, raw_c, raw_d = (tf.cast(t, dtype) for t in self._raw_parameters(xs, ys))
        return {
            "a": 1.0 + raw_a,
            "b": self._exponent(raw_b, self.b_range),
            "c": self._exponent(raw_c, self.c_range),
            "d": 1.0 / self.num_terms + raw_d,
        }

    def evaluate_terms(self, parameters: dict[str, tf.Tensor], x, *, per_term: bool = False) -> tf.Tensor:
        """The fitted function ``sum_k d_k pow(pow(a_k x, b_k), c_k)`` at any points ``x``.

        Use it to draw a fit on a dense grid: ``parameters`` from
        :meth:`predict_parameters` on the samples, ``x`` the grid.

        Args:
            parameters: a dict like the one :meth:`predict_parameters` returns.
            x: tensor ``(batch, m, 1)``: the points to evaluate at.
            per_term: return each term, ``(batch, m, K)``, instead of their sum.

        Returns:
            A tensor ``(batch, m, 1)`` (or ``(batch, m, K)``) in the basis dtype.
        """
        dtype = self._basis_dtype()
        a, b, c, d = (tf.cast(parameters[name], dtype)[:, None, :] for name in "abcd")
        u = a * tf.cast(x, dtype)  # (batch, m, K): x -> a x
        f = self._power(u, b)  # x -> x^b
        f = self._power(f, c)  # f -> f^c
        terms = d * f  # f -> d f
        return terms if per_term else tf.reduce_sum(terms, axis=-1, keepdims=True)

    def call(self, inputs, training=None):
        xs, _ = self._split_inputs(inputs)
        prediction = self.evaluate_terms(self.predict_parameters(inputs), xs)
        return tf.cast(prediction, self.compute_dtype)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[0])

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_terms": self.num_terms,
                "d_model": self.d_model,
                "num_heads": self.num_heads,
                "key_dim": self.key_dim,
                "fixes": list(self.fixes),
                "b_range": list(self.b_range),
                "c_range": list(self.c_range),
                "log_exp_eps": self.log_exp_eps,
            }
        )
        return config


@keras.saving.register_keras_serializable(package="companion.book")
class BasisPower(keras.Model):
    """Case A's basis transforms on one term: ``d * (a * x) ** b``, with ``a``, ``b``, ``d`` learned.

    The seed question's model without its attention: ``x -> a x``, ``x -> x ** b`` and
    ``f -> d f``, computed with ``tf.pow`` as the question does (or with
    :func:`companion.numerics.safe_pow` when ``safe=True``). Trained towards
    ``sqrt(x)`` on inputs that include ``x = 0``, ``b`` falls from its start below 1,
    where the gradient of ``tf.pow`` with respect to its base, ``b (a x) ** (b - 1)``, is
    infinite at 0: a ``NaN`` after many finite steps.

    Args:
        b: the exponent's initial value (``a`` and ``d`` start at 1).
        safe: compute the power with :func:`companion.numerics.safe_pow`.
        **kwargs: passed to ``keras.Model``.

    Example:
        >>> model = BasisPower(b=2.0)
        >>> float(model(tf.constant([[3.0]]))[0, 0])
        9.0
    """

    def __init__(self, b: float = 2.0, safe: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.initial_b, self.safe = float(b), bool(safe)
        self.a = self.add_weight(shape=(), initializer="ones", name="a")
        self.b = self.add_weight(shape=(), initializer=keras.initializers.Constant(self.initial_b), name="b")
        self.d = self.add_weight(shape=(), initializer="ones", name="d")

    def call(self, x):
        if self.safe:
            return self.d * safe_pow(self.a * x, self.b)
        return self.d * tf.pow(self.a * x, self.b)

    def get_config(self):
        return {**super().get_config(), "b": self.initial_b, "safe": self.safe}

