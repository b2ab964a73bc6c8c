"""Private TensorFlow/Keras APIs, one family: the global random-number states.

Each hook says what it relies on and what happens when it is gone, and is registered
(:func:`companion._internal.registry.hook`) with its canary tests.
"""

from __future__ import annotations



from companion._internal.registry import hook, warn_once


# --------------------------------------------------------------------------------------
# The global random-number states (the NaN doctor's re-run changes nothing)
# --------------------------------------------------------------------------------------
# Relies on: Keras 3 keeping the ``SeedGenerator`` that random ops without a seed draw
# from (``keras.random.normal(shape)``, a layer that calls ``keras.random.dropout``
# without one) as the global attribute ``"global_seed_generator"`` of
# ``keras.src.backend.common.global_state``, its state in ``.state``; and TensorFlow
# keeping its global ``tf.random.Generator`` in ``stateful_random_ops.global_generator``
# (``None`` until ``tf.random.get_global_generator()`` first creates it).
# Why: the doctor's re-run of a batch must not advance them, or the steps after a
# diagnosed skip draw other random numbers than a run without the doctor.
# If gone: those states are not restored (a re-run of a model that draws unseeded
# random numbers then moves them on), with a warning.


@hook('test_the_global_random_states_are_found_and_move_when_drawn_from')
def global_random_states() -> list:
    """The state variables of Keras' and TensorFlow's global random generators that exist now."""
    states = []
    try:
        from keras.src.backend.common import global_state
    except ImportError:  # pragma: no cover - depends on the Keras version
        warn_once("global_seed_generator", "keras' global_state module is gone: the global SeedGenerator's state "
                  "is not restored after the NaN doctor's re-run")
    else:
        generator = global_state.get_global_attribute("global_seed_generator")
        if generator is not None and getattr(generator, "state", None) is not None:
            states.append(generator.state)
    try:
        from tensorflow.python.ops import stateful_random_ops
    except ImportError:  # pragma: no cover - depends on the TensorFlow version
        warn_once("global_generator", "tensorflow's stateful_random_ops is gone: the global tf.random.Generator "
                  "is not restored after the NaN doctor's re-run")
    else:
        generator = getattr(stateful_random_ops, "global_generator", None)
        if generator is not None:
            states.append(generator.state)
    return states
