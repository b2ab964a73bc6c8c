"""Every use of a private TensorFlow or Keras API in :mod:`companion`, in one package.

No other module of the package names a private TensorFlow/Keras module, attribute or
error text (``tests/contracts/test_tf_internals.py`` reads the sources, ``getattr``
spellings included). Each family of internals is a module:

* :mod:`~companion._internal.variables`: variable writes while tracing (the masked
  update), a variable's initial value that restores a checkpoint;
* :mod:`~companion._internal.optimizers`: the all-reduce inside a Keras optimizer's ``apply``,
  the learning rate as given and the variables it was built on;
* :mod:`~companion._internal.keras_trainer`: Keras' trainer and layers (``fit``'s frames
  and batches, its symbolic build, the compiled state, callbacks' defaults, the
  multi-step loop, the step functions fit keeps on the model);
* :mod:`~companion._internal.distribute`: ``tf.distribute`` (multi-worker mode, merge
  calls, collective keys);
* :mod:`~companion._internal.ops`: op callbacks, check-numerics, eager backprop's frames;
* :mod:`~companion._internal.errors`: TensorFlow's error texts;
* :mod:`~companion._internal.random_states`: the global random-number states;
* :mod:`~companion._internal.datasets`: a ``tf.data`` pipeline's map functions.

Each hook says what it relies on and what happens when it is gone: the caller falls back
to a public, slower or less informative way, and :func:`warn_once` issues an
:class:`InternalAPIWarning` the first time (never a silent fall-back, and an error in the
test suite). Each is registered in :data:`HOOKS` with the canary tests that fail loudly when
an upgrade of TensorFlow or Keras removes what it relies on (:mod:`.registry`).

The hooks are re-exported here: callers write ``_internal.all_layers(model)``.
"""

from __future__ import annotations

from companion._internal.registry import HOOKS, Hook, InternalAPIWarning, hook, warn_once
from companion._internal.distribute import (
    in_multi_worker_mode,
    isolate_collective_keys,
    strategy_supports_no_merge_call,
)
from companion._internal.errors import (
    collective_error_summary,
    looks_like_xla_failure,
    tasks_named_in,
    xla_failure_summary,
)
from companion._internal.keras_trainer import (
    STEP_FUNCTION_ATTRIBUTES,
    all_layers,
    build_compiled_state,
    is_default_callback_method,
    multi_step_loop_ends_short_calls,
    own_step_unbuilt,
    repair_symbolic_build_for_multi_worker,
    running_fit_arguments,
    running_fit_locals,
    step_function_attributes,
    tap_fit_batches,
    undo_symbolic_build_repair,
)
from companion._internal.ops import (
    READ_OPS, backprop_forward_op, check_numerics_enabled, debug_events_reader, disable_op_determinism,
    functional_op_writes, in_backprop, op_callback, op_determinism_enabled,
)
from companion._internal.optimizers import (
    can_skip_optimizer_all_reduce, learning_rate_as_given, optimizer_all_reduce_skipped, variables_built_on,
)
from companion._internal.random_states import global_random_states
from companion._internal.datasets import dataset_map_stages
from companion._internal.variables import (
    intercept_variable_writes,
    is_checkpoint_restore,
    variable_writes_interceptable,
    variable_writes_patched,
)
