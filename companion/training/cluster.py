"""The workers of a multi-worker run as :func:`companion.training.train` sees them:
who is the chief, one small all-reduce to agree on numbers, and the
:class:`~companion.training.WorkerLostError` for a collective that failed because a
peer is gone (chapter *Training across machines*).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref

import numpy as np
import tensorflow as tf

from companion import _internal
from companion.training.results import TrainingHistory, WorkerLostError


#: Errors a collective op raises when a peer is gone (crashed, unreachable, timed out).
PEER_FAILURES = (
    tf.errors.UnavailableError,
    tf.errors.DeadlineExceededError,
    tf.errors.CancelledError,
    tf.errors.AbortedError,
)


def _replica_rows(value: tf.Tensor) -> tf.Tensor:
    """``value`` of every replica, one row per replica: one all-reduce in a replica context.

    Each replica puts its ``value`` in its own row of zeros and the rows are summed:
    exact, and it works on values that live on no particular device, unlike
    ``all_gather``.
    """
    context = tf.distribute.get_replica_context()
    rows = tf.one_hot(context.replica_id_in_sync_group, context.num_replicas_in_sync)[:, None]
    return context.all_reduce(tf.distribute.ReduceOp.SUM, rows * value[None, :])


#: The compiled :func:`_replica_rows` of each strategy (a :class:`Cluster` is made per run).
_GATHERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _gather_function(strategy: tf.distribute.Strategy):
    """The ``tf.function`` that runs :func:`_replica_rows` on every replica of ``strategy``.

    One per strategy, whose input's length is unknown when it is traced: it compiles
    once for every length and every run. TensorFlow counts the traces of one Python
    function over every ``tf.function`` made of it, and warns ("triggered tf.function
    retracing") after five in ten calls: a function per run, or one traced again for
    each new length, would.
    """
    function = _GATHERS.get(strategy)
    if function is None:
        ref = weakref.ref(strategy)  # the cache must not keep its own key alive
        function = tf.function(
            lambda value: ref().run(_replica_rows, args=(value,)),
            input_signature=[tf.TensorSpec([None], tf.float32)],
            autograph=False,
        )
        _GATHERS[strategy] = function
    return function


class Cluster:
    """The workers of a multi-worker strategy, as :func:`train` sees them."""

    def __init__(self, strategy: tf.distribute.Strategy) -> None:
        resolver = strategy.cluster_resolver
        self.strategy = strategy
        self.task_type = resolver.task_type
        self.task_id = int(resolver.task_id)
        spec = resolver.cluster_spec()
        self.workers = sum(spec.num_tasks(job) for job in spec.jobs if job in ("chief", "worker"))
        self.is_chief = bool(strategy.extended.should_checkpoint)

    @classmethod
    def of(cls, strategy: tf.distribute.Strategy) -> "Cluster | None":
        """The cluster of ``strategy``, or ``None`` if it runs in this process only."""
        if not _internal.in_multi_worker_mode(strategy):
            return None
        return cls(strategy)

    @property
    def task(self) -> str:
        return f"{self.task_type} {self.task_id}"

    def gather(self, *values: float) -> np.ndarray:
        """``values`` of every replica, one row per replica (one small all-reduce).

        Every worker must call it with the same number of values. It runs
        :func:`_gather_function`, traced once per strategy for every length, so the
        loop's one number and the NaN doctor's rows and payloads
        (:mod:`companion.diagnostics.hooks`) never retrace it, in any number of runs.
        """
        result = _gather_function(self.strategy)(tf.constant(np.asarray(values, np.float32)))
        return self.strategy.experimental_local_results(result)[0].numpy()

    def lost(self, error: Exception, epoch: int, history: TrainingHistory, checkpoint) -> WorkerLostError:
        """The :class:`WorkerLostError` for a collective that failed with ``error``."""
        text = str(error)
        peers = _internal.tasks_named_in(text)
        if isinstance(error, tf.errors.DeadlineExceededError) or "timed out" in text:
            cause = (
                "a collective operation timed out (the timeout_seconds of the strategy's communication_options): "
                "a peer is gone or stuck"
            )
        elif "heartbeat" in text:
            cause = f"the coordination service stopped receiving heartbeats from {', '.join(peers) or 'a peer'}"
        else:
            cause = f"{', '.join(peers) or 'a peer'} is unreachable"
        latest = checkpoint.latest if checkpoint is not None else None
        if latest is not None:
            resume = (
                f"restart all workers with the same checkpoint_dir to resume from {latest!r} "
                f"(after epoch {int(latest.rsplit('-', 1)[-1])})"
            )
        elif checkpoint is not None:
            resume = "restart all workers; no epoch had completed, so training starts again from the beginning"
        else:
            resume = "restart all workers (pass checkpoint_dir to resume after the last completed epoch)"
        first_line = _internal.collective_error_summary(text) or type(error).__name__
        return WorkerLostError(
            f"{self.task} of {self.workers} lost a peer during epoch {epoch + 1}: {cause} "
            f"({type(error).__name__}: {first_line[:300]}). TensorFlow aborted this process's collective "
            f"operations, so training cannot continue here; {resume}.",
            task=self.task,
            peers=peers,
            epoch=epoch,
            checkpoint=latest,
            history=history,
        )


#: After a :class:`WorkerLostError`, the longest the process lives on (``on_worker_loss="exit"``).
WORKER_LOSS_EXIT_SECONDS = 30.0
_exit_armed = threading.Event()


def _end_process() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # pragma: no cover - a closed stream
            pass
    os._exit(1)


def _exit_later(seconds: float) -> None:
    threading.Event().wait(seconds)
    print(
        f"companion.training: the process is still running {seconds:g} s after WorkerLostError; ending it "
        "(exit code 1), as TensorFlow's runtime is blocked on the lost peer",
        file=sys.stderr,
    )
    _end_process()


def arm_exit_after_worker_loss(seconds: float = WORKER_LOSS_EXIT_SECONDS) -> None:
    """End this process (exit code 1) at interpreter exit, or ``seconds`` from now at the latest.

    After a peer is lost, TensorFlow's runtime can keep the process alive: threads of the
    input pipeline blocked in Python (``tf.py_function``), collective ops waiting for the
    dead peer, gRPC and coordination-service shutdown waiting for it. A survivor that
    never exits is never restarted by its scheduler, so once :class:`WorkerLostError` is
    raised the process ends: at interpreter exit without TensorFlow's teardown, or after
    ``seconds`` (the time the caller has to log or save what it needs) from a daemon
    thread. Pass ``on_worker_loss="raise"`` to :func:`companion.training.train` to keep
    the process alive instead.
    """
    if _exit_armed.is_set():
        return
    _exit_armed.set()
    atexit.register(_end_process)
    threading.Thread(target=_exit_later, args=(seconds,), name="companion-exit-after-worker-loss", daemon=True).start()

