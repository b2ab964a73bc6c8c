"""Private TensorFlow/Keras APIs, one family: ``tf.distribute``: multi-worker mode, replica-context all-reduce, collective keys.

Each hook says what it relies on and what happens when it is gone, and is registered
(:func:`companion._internal.registry.hook`) with its canary tests.
"""

from __future__ import annotations

import threading

import tensorflow as tf

from companion._internal.registry import hook, warn_once


# --------------------------------------------------------------------------------------
# Whether a strategy spans several workers
# --------------------------------------------------------------------------------------
# Relies on: ``strategy.extended._in_multi_worker_mode()`` (TensorFlow's own test for
# "this strategy has a cluster of several tasks").
# If gone: a ``MultiWorkerMirroredStrategy`` whose cluster spec has more than one task.


@hook('test_strategies_say_whether_they_span_several_workers')
def in_multi_worker_mode(strategy: tf.distribute.Strategy) -> bool:
    """Whether ``strategy`` runs on several workers (processes)."""
    method = getattr(strategy.extended, "_in_multi_worker_mode", None)
    if method is not None:
        return bool(method())
    warn_once(
        "_in_multi_worker_mode",
        "tf.distribute strategies have no extended._in_multi_worker_mode: multi-worker mode is inferred from "
        "the cluster spec",
    )
    resolver = getattr(strategy, "cluster_resolver", None)
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or resolver is None:
        return False
    spec = resolver.cluster_spec()
    return sum(spec.num_tasks(job) for job in spec.jobs) > 1


# --------------------------------------------------------------------------------------
# Replica-context optimizers without merge_call
# --------------------------------------------------------------------------------------
# Relies on: ``tf.__internal__.distribute.strategy_supports_no_merge_call()``, which
# Keras' own optimizers use to decide between an all-reduce in replica context and a
# ``merge_call``.
# If gone: ``merge_call`` (works under every strategy; a little slower).


@hook('test_replica_context_all_reduce_support_is_reported')
def strategy_supports_no_merge_call() -> bool:
    """Whether the current strategy can all-reduce in replica context."""
    internal = getattr(getattr(tf.__internal__, "distribute", None), "strategy_supports_no_merge_call", None)
    if internal is None:  # pragma: no cover - depends on the TensorFlow version
        warn_once(
            "strategy_supports_no_merge_call",
            "tf.__internal__.distribute.strategy_supports_no_merge_call is gone: SkipNonFinite uses merge_call",
        )
        return False
    return bool(internal())


# --------------------------------------------------------------------------------------
# Two MirroredStrategys in one process (companion.training.step)
# --------------------------------------------------------------------------------------
# Relies on: ``MirroredStrategy.extended._collective_keys``, a
# ``tensorflow.python.distribute.cross_device_utils.CollectiveKeys`` whose instance keys
# start at the same number (``_instance_key_table[group][device]``) in every strategy,
# with the same group key (1). TensorFlow's runtime caches a collective's parameters by
# (group key, instance key), so a second strategy in the same process reuses the keys of
# the first with other shapes and aborts ("Shape mismatch in the collective instance
# 100"), with fit as with train. Each strategy train runs under gets instance keys of
# its own range.
# If gone: nothing is changed (a warning says so); two strategies in one process then
# abort as they do with fit.

_INSTANCE_KEY_STRIDE = 1_000_000
_collective_ranges = [0]
_collective_lock = threading.Lock()


@hook('test_mirrored_strategy_keeps_collective_instance_keys_where_the_isolation_moves_them')
def isolate_collective_keys(strategy) -> None:
    """Give a single-worker ``strategy`` collective instance keys unused in this process."""
    keys = getattr(strategy.extended, "_collective_keys", None)
    table = getattr(keys, "_instance_key_table", None)
    if not isinstance(table, dict):
        warn_once(
            "_collective_keys",
            "MirroredStrategy has no _collective_keys._instance_key_table: two strategies in one process may "
            "abort with a collective shape mismatch",
        )
        return
    with _collective_lock:
        if getattr(keys, "_companion_isolated", False):
            return
        # (A strategy used already just continues in the new range: its keys only grow.)
        _collective_ranges[0] += 1
        offset = _collective_ranges[0] * _INSTANCE_KEY_STRIDE
        for group in table.values():
            for device in group:
                group[device] += offset
        keys._companion_isolated = True
