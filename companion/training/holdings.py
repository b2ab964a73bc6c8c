"""What a model holds that its training step may write, found on the model.

:func:`model_optimizers`: ``model.optimizer`` and every other optimizer the model or one
of its layers holds (a GAN's ``d_optimizer`` and ``g_optimizer``), whose state the
guarded step puts back after a skipped step and whose ``apply`` it intercepts.
:func:`random_state`: the state of every ``keras.random.SeedGenerator``, which a skipped
step leaves moved on (a skipped random draw is not drawn again), and which a rollback
does not restore either.
"""

from __future__ import annotations

import keras

from companion import _internal


def random_state(model) -> list:
    """The state of every ``keras.random.SeedGenerator`` of ``model`` (moves on when skipped)."""
    found = []
    for layer in _internal.all_layers(model):
        for value in vars(layer).values():
            if isinstance(value, keras.random.SeedGenerator):
                found.append(value.state)
    found.extend(v for v in model.variables if v.name == "seed_generator_state")
    return found


def model_optimizers(model) -> list:
    """``model.optimizer`` and every other optimizer the model or one of its layers holds
    (a GAN's ``d_optimizer`` and ``g_optimizer``), each once; a loss-scale optimizer's
    inner optimizer is not listed apart from it."""
    found: list = []

    def add(value):
        if isinstance(value, keras.optimizers.Optimizer) and all(value is not o for o in found):
            inner = getattr(value, "inner_optimizer", None)
            found[:] = [o for o in found if o is not inner]
            if not any(getattr(o, "inner_optimizer", None) is value for o in found):
                found.append(value)

    add(getattr(model, "optimizer", None))
    for layer in _internal.all_layers(model):
        for value in list(vars(layer).values()):
            if isinstance(value, (list, tuple)):
                for item in value:
                    add(item)
            elif isinstance(value, dict):
                for item in value.values():
                    add(item)
            else:
                add(value)
    return found
