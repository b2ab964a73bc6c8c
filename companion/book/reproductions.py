"""The seeds' failing code, faithfully, so chapters and tests can show the failure.

Everything here is *wrong on purpose*: each function is the code of one of the book's two
seed questions (``shared/seeds/``), copied as its author wrote it, bugs included, so that a
chapter can run it and show where it breaks, and a test can pin that the failure is real
in the TensorFlow the book is tested with. Do not use these functions in a model; the
fixed versions live in :mod:`companion.numerics` (and the other modules), and each
docstring below says which one.

The only changes to the seeds' code are the ones needed to make it importable: a name,
a docstring, and ``tf.convert_to_tensor`` on the input (the seeds passed tensors).

Sections:
    Case A (seed ``000``): ParameterNet, its attention, its training step, its checks.
    Case B (seed ``003``): f(x) = 1/(1 - e^-x) - 1/x in a custom loss.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = [
    "naive_tilted_mean",
    "seed_blended_f",
    "seed_bounded_exponent",
    "seed_checked_power",
    "seed_gradients",
    "seed_gradient_formula",
    "seed_question_f",
    "seed_scaled_dot_product_attention",
    "seed_taylor",
    "seed_train_step",
]


# --- Case A: ParameterNet (seed 000) ---------------------------------------------------
#
# The question shows no code for its model (companion.book.models.ParameterNet(fixes=()) is
# that model); these are the answer's code pieces.


def seed_scaled_dot_product_attention(q, k, v) -> tf.Tensor:
    """The answer's "scaled dot-product attention", verbatim.

    Its value is right for float32 inputs without a mask, but:

    - ``d_k = tf.cast(q.shape[-1], tf.float32)`` fixes the scores' dtype to float32, so
      float16 or bfloat16 inputs (mixed precision) fail with a dtype error in the
      division, and float64 ones too;
    - it takes no mask, so padded points cannot be excluded (adding ``-1e9`` to the scores,
      the usual patch, is ``-inf`` in float16 and gives NaN for a fully masked row);
    - scaling does not address case A's NaN, which comes from the power at 0, not from
      the softmax: the softmax is finite for any finite scores, scaled or not.

    The fix is :func:`companion.attention.scaled_dot_product_attention`.
    """
    q, k, v = (tf.convert_to_tensor(t) for t in (q, k, v))
    # --- from here on, the seed's code as written ---
    d_k = tf.cast(q.shape[-1], tf.float32)
    scores = tf.matmul(q, k, transpose_b=True) / tf.sqrt(d_k)
    attn_weights = tf.nn.softmax(scores, axis=-1)
    output = tf.matmul(attn_weights, v)
    return output


def seed_train_step(model, optimizer):
    """The answer's ``train_step``, verbatim, for a given ``model`` and ``optimizer``.

    The answer's function uses the globals ``model`` and ``optimizer`` (with
    ``optimizer = tf.keras.optimizers.Adam(learning_rate=1e-4)``); here they are
    arguments, and the ``tf.function`` it returns is the answer's::

        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                pred = model(x)
                loss = tf.keras.losses.MSE(y, pred)
            grads = tape.gradient(loss, model.trainable_variables)
            grads, _ = tf.clip_by_global_norm(grads, clip_norm=1.0)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

    How it fails:

    - ``tf.clip_by_global_norm`` computes one norm over all gradients: one NaN entry
      makes the norm NaN and *every* clipped gradient NaN, so the step writes NaN into
      every weight, where plain Adam would have spoilt only the variables whose gradient
      was NaN;
    - nothing checks the gradients: the step is applied whatever they are, and the loss
      it returns is the one computed *before* the update, so it is still finite at the
      step that destroys the weights;
    - ``tf.keras.losses.MSE`` averages over the last axis only, so ``loss`` is a tensor
      (one value per point for ParameterNet's ``(batch, n, 1)`` outputs) and the
      gradient is that of its *sum*: the learning rate is implicitly scaled by
      ``batch * n``.

    The fix is :func:`companion.training.train`, which checks every gradient inside
    the compiled step and skips a non-finite step.

    Args:
        model: a Keras model, called as ``model(x)``.
        optimizer: a Keras optimizer.

    Returns:
        The answer's ``train_step(x, y)``, a ``tf.function`` returning the loss tensor.
    """

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            pred = model(x)
            loss = tf.keras.losses.MSE(y, pred)
        grads = tape.gradient(loss, model.trainable_variables)
        # global gradient clipping: limit the norm of the gradients
        grads, _ = tf.clip_by_global_norm(grads, clip_norm=1.0)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return train_step


def seed_gradients(model):
    """The answer's ``train_step`` up to its gradients: no clipping, no update.

    The same loss and tape as :func:`seed_train_step`, returning the gradients instead of
    applying them, so that a step that does not write variables can be run again: by
    :func:`companion.diagnostics.diagnose_function`, which re-runs such a step with its
    remedy applied (``checked: verified ...``).

    Args:
        model: a Keras model, called as ``model(x)``.

    Returns:
        ``gradients(x, y)``: the gradients of the answer's loss with respect to
        ``model.trainable_variables``.
    """

    def gradients(x, y):
        with tf.GradientTape() as tape:
            loss = tf.keras.losses.MSE(y, model(x))
        return tape.gradient(loss, model.trainable_variables)

    return gradients


def seed_checked_power(x, a, b) -> tf.Tensor:
    """The answer's ``forward_pass`` with ``tf.debugging.check_numerics``, for ``(a x)^b``.

    The answer's function stops after the power (``# then check the remaining
    transforms...``) and returns an undefined ``pred``; this is its part that runs::

        x = a * x
        tf.debugging.check_numerics(x, "After a*x transform")
        x = tf.pow(x, b)
        tf.debugging.check_numerics(x, "After x^b transform")

    How it fails: ``tf.debugging.check_numerics`` returns its input, checked, and
    TensorFlow registers a gradient for it that checks the gradient flowing back into
    that returned tensor. The seed discards the returned tensor, so only the forward
    values are checked, and case A's forward values are finite: at ``x = 0`` with
    ``b < 1`` both checks pass while the gradient with respect to ``a`` is NaN
    (``0 * inf`` in the backward pass of ``tf.pow``). Written
    ``x = tf.debugging.check_numerics(x, ...)``, the first check would catch the
    backward Inf, eagerly and in a ``tf.function``; under ``jit_compile=True`` XLA
    compiles ``CheckNumerics`` as the identity and neither form checks anything
    (TensorFlow issues #117319 and #118075). It also raises rather than letting
    training skip a step. The chapter ``case_a/clipping_and_guards`` shows all three.

    The fix is :func:`companion.numerics.safe_pow`; to locate a NaN in the backward pass,
    :mod:`companion.diagnostics`.
    """
    x = tf.convert_to_tensor(x)
    # --- from here on, the seed's code as written (comments translated) ---
    x = a * x
    tf.debugging.check_numerics(x, "After a*x transform")
    x = tf.pow(x, b)
    tf.debugging.check_numerics(x, "After x^b transform")
    return x


def seed_bounded_exponent(b_raw) -> tf.Tensor:
    """The answer's bounded exponent, verbatim: ``0.1 + 1.9 * tf.sigmoid(b_raw)``.

    How it fails: it bounds the exponent to [0.1, 2.0], which keeps it finite but
    contains every exponent below 1, where ``tf.pow(0, b)`` has an infinite base-side
    derivative. It starts at ``b = 1.05`` for ``b_raw = 0``, not at 1 as the answer's
    section 4 advises; ``bounded_inverse`` gives the ``b_raw`` for a chosen start.

    The fix is :func:`companion.numerics.bounded` with
    :func:`companion.numerics.bounded_inverse`, together with
    :func:`companion.numerics.safe_pow`.
    """
    b_raw = tf.convert_to_tensor(b_raw)
    return 0.1 + 1.9 * tf.sigmoid(b_raw)


# --- Case B: f(x) = 1/(1 - e^-x) - 1/x (seed 003) --------------------------------------


def naive_tilted_mean(x) -> tf.Tensor:
    """The question's f, typed straight from its formula: ``1/(1 - exp(-x)) - 1/x``.

    How it fails:

    - at ``x = 0`` it is ``inf - inf = NaN`` (the question defines f(0) = 1/2 separately);
    - near 0 both terms are about ``1/x`` and their difference keeps few correct bits:
      in float32 it returns about -1.3e4 at ``x = 1e-6`` and -4.9e4 at ``x = -1e-6``
      (true value 0.5), with gradients of order 1e10;
    - once ``exp(-x)`` overflows (``x < -88.7`` in float32, ``x < -709.8`` in float64)
      the value is still right but the gradient is NaN: the backward pass multiplies
      ``-(1/(1 - exp(-x)))**2 = -0`` by ``exp(-x) = inf``, and ``0 * inf`` is NaN (the
      derivative f'(x) = 1/x^2 - exp(-x) / (1 - exp(-x))^2 written as one expression
      would be ``inf / inf`` there).

    The fix is :func:`companion.numerics.tilted_mean`.
    """
    x = tf.convert_to_tensor(x)
    return 1 / (1 - tf.exp(-x)) - 1 / x


def seed_blended_f(x) -> tf.Tensor:
    """The answer's "smooth piecewise approximation" of f, verbatim (its ``def f(x)``).

    It blends a Taylor polynomial, two asymptotes and the original formula with sigmoid
    masks. How it fails, measured with TF 2.21 in float32:

    - ``mask_neg`` is inverted: it is ~1 for every ``x > -10``, so between -10 and 10 the
      blend is the *negative-x* asymptote -1/x, not the original formula:
      ``seed_blended_f(1.0)`` is -1 (true value 0.582), ``seed_blended_f(5.0)`` is -0.2;
    - ``seed_blended_f(1e-6)`` is about -44.9 (true value 0.5): ``mask_zero`` is
      sigmoid(10), which leaves ~4.5e-5 of that -1/x = -1e6 in the result;
    - ``seed_blended_f(0)`` is NaN: every branch is evaluated everywhere, and
      ``0 * (1/0)`` is NaN however small the mask;
    - the value is also NaN for 0 < abs(x) <= 3e-8, where ``exp(-x)`` rounds to 1 and
      ``original`` is inf, and for abs(x) > 7e12, where ``x**3`` overflows in the Taylor
      branch: each time an infinite branch times a weight that is exactly 0 in float32;
    - the gradient is NaN wherever the value is, and for *every* x < -88.7 (the
      ``original`` branch's ``exp(-x)`` overflows there and its derivative is
      ``0 * inf = NaN``, which no weight, 0 or 1, removes);
    - its Taylor term ``+x^3/720`` has the wrong sign: f = 1/2 + x/12 - x^3/720 + ...

    The fix is :func:`companion.numerics.tilted_mean`.
    """
    x = tf.convert_to_tensor(x)
    # --- from here on, the seed's code as written (comments translated) ---
    # Near x = 0: a third-order Taylor expansion (closer to the gradient of the original)
    taylor = 0.5 + x/12 + tf.pow(x, 3)/720
    # x > 10: approximately 1 - 1/x (the limit of the original)
    large_pos = 1 - 1/x
    # x < -10: approximately -1/x (the limit of the original)
    large_neg = -1/x
    # the middle region uses the original formula
    original = 1/(1 - tf.exp(-x)) - 1/x

    # smooth switching masks: a sigmoid soft transition avoids the
    # gradient jump of a hard switch
    # transition between x < -10 and the middle region
    mask_neg = tf.sigmoid((x + 10)/0.5)
    # transition between x > 10 and the middle region
    mask_pos = tf.sigmoid((10 - x)/0.5)
    # transition between |x| < 0.1 and the middle region
    mask_zero = tf.sigmoid((0.1 - tf.abs(x))/0.01)

    # combine the regions
    res = mask_neg * large_neg + (1 - mask_neg) * original
    res = mask_pos * res + (1 - mask_pos) * large_pos
    res = mask_zero * taylor + (1 - mask_zero) * res

    return res


def seed_taylor(x) -> tf.Tensor:
    """The ``taylor`` line of :func:`seed_blended_f` on its own: ``0.5 + x/12 + x^3/720``.

    The sign of its cubic term is wrong: with f = 1/2 + sum_k B_2k x^(2k-1) / (2k)! and
    B_4 = -1/30, the series is f = 1/2 + x/12 - x^3/720 + x^5/30240 - ..., so this
    polynomial is off by about x^3/360 where the correct one is off by x^5/30240.
    """
    x = tf.convert_to_tensor(x)
    return 0.5 + x/12 + tf.pow(x, 3)/720


def seed_question_f(x) -> tf.Tensor:
    """The question's own f, as the answer describes it: a ``tf.where`` with ``0.5 + x/12``.

    The seed quotes the answer, not the question's code; the answer describes that code as
    (seed ``003``, translated)::

        原实现仅用一阶泰勒近似0.5+x/12覆盖|x|<0.1的区域
        "the original implementation only used the first-order Taylor approximation
        0.5 + x/12 on the region |x| < 0.1"

        tf.where的硬分支切换会导致函数梯度在边界处不连续
        "the hard branch switch of tf.where makes the gradient discontinuous at the
        boundary"

    and it tells the asker to keep ``tf.keras.backend.set_floatx('float64')``, so the
    question ran in float64. This function is that description, and nothing more::

        tf.where(tf.abs(x) < 0.1, 0.5 + x / 12, 1 / (1 - tf.exp(-x)) - 1 / x)

    How it fails: not at the switch (there the value jumps by about
    0.1^3/720 = 1.4e-6 and the slope by 0.1^2/240 = 4.2e-5, harmless for training), but
    through the ``tf.where`` trap. ``tf.where`` computes both branches everywhere and its
    gradient multiplies the unused one's derivative by 0; where that derivative is NaN,
    0 * NaN is NaN:

    - at x = 0 (and so at x = -50 in the question's f(x) + f(x + 50)) the value is the
      right 0.5, and the gradient is NaN: the formula's branch is inf - inf there;
    - for x < -log(max) (-709.78 in float64, -88.72 in float32) ``exp(-x)`` overflows and
      the gradient is NaN while the value is right, as for :func:`naive_tilted_mean`;
    - in float32 (Keras' default dtype), the formula's branch is used down to
      abs(x) = 0.1, where it keeps about 4 correct digits.

    The fix is :func:`companion.numerics.tilted_mean`; the general fix for the trap is
    :func:`companion.numerics.double_where`. The chapter that shows it:
    ``book/case_b/reproduce``.

    Args:
        x: a floating-point tensor (or something ``tf.convert_to_tensor`` accepts).

    Returns:
        The question's f at ``x``, same shape and dtype.

    Example:
        >>> x = tf.constant([0.0, -1000.0], tf.float64)
        >>> with tf.GradientTape() as tape:
        ...     tape.watch(x)
        ...     y = seed_question_f(x)
        >>> y.numpy().round(6), tape.gradient(y, x).numpy()
        (array([0.5  , 0.001]), array([nan, nan]))
    """
    x = tf.convert_to_tensor(x)
    return tf.where(tf.abs(x) < 0.1, 0.5 + x / 12, 1 / (1 - tf.exp(-x)) - 1 / x)


def seed_gradient_formula(x) -> tf.Tensor:
    """The answer's formula for "the gradient of the original formula", as written.

    The answer (seed ``003``) says: "当x→-∞时，exp(-x)会溢出为inf，直接计算原公式的梯度
    exp(-x)/(1-exp(-x))²会出现inf/inf的NaN情况" ("as x -> -inf, exp(-x) overflows to inf,
    and computing the original formula's gradient exp(-x)/(1-exp(-x))^2 directly gives
    inf/inf, a NaN"). This function evaluates that expression::

        tf.exp(-x) / (1 - tf.exp(-x)) ** 2

    It is not the derivative of f(x) = 1/(1 - e^-x) - 1/x, which is

        f'(x) = 1/x^2 - e^-x / (1 - e^-x)^2

    The answer's formula is the derivative of the first term with its sign flipped, and
    it lacks the 1/x^2 of the second: at x = 1 it is 0.921 where f'(1) = 0.0793, and it
    tends to +inf at 0 where f'(0) = 1/12. As an expression it is inf/inf = NaN once
    ``exp(-x)`` overflows; TensorFlow's backward pass of the naive f never forms that
    ratio, and gets its NaN as 0 * inf (``-(1/u)^2`` is -0 times ``e^-x = inf``).

    The chapter that examines it: ``book/case_b/reproduce``.

    Args:
        x: a floating-point tensor (or something ``tf.convert_to_tensor`` accepts).

    Returns:
        ``exp(-x) / (1 - exp(-x))**2``, same shape and dtype as ``x``.

    Example:
        >>> seed_gradient_formula(tf.constant([1.0, -100.0])).numpy().round(4)
        array([0.9207,    nan], dtype=float32)
    """
    x = tf.convert_to_tensor(x)
    return tf.exp(-x) / (1 - tf.exp(-x)) ** 2
