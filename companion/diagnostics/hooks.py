"""The diagnosis of the first step :func:`companion.training.train` skips.

:func:`diagnose_skipped_step` is called by the training loop once, when it records its
first skipped step, and never on a step that applied its update, so the doctor costs
nothing while training is clean. It re-reads the step's batch from the training data
(the same batch if the input pipeline is deterministic; else it scans the epoch) and
diagnoses it with the model's weights, which a skipped step left unchanged.

The re-run changes nothing: every local copy of every variable of the model and the
optimizer (batch-normalisation statistics, dropout seed generators, which under a
distribution strategy differ from replica to replica) and the states of Keras' and
TensorFlow's global random generators are restored afterwards, each copy to its own
value (:mod:`companion.diagnostics.state`). Under a distribution strategy each local
replica's part of the batch is diagnosed on its own, outside the strategy's
collectives. With several workers, every worker then joins the same two small
all-reduces, whatever its own doctor found (or raised): the first says which workers
found the NaN, the second hands the first such worker's diagnosis to all, so every
worker records the same :class:`Diagnosis`, naming the worker whose shard made the NaN.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from typing import Any

import numpy as np
import tensorflow as tf

from companion import _internal
from companion.diagnostics.diagnosis import Diagnosis, replace
from companion.diagnostics.doctor import diagnose
from companion.diagnostics.state import preserved
from companion.diagnostics.step import uses_own_step

__all__ = ["diagnose_skipped_step"]

#: The diagnosis travels between workers as UTF-8 bytes, padded to a multiple of this.
PAYLOAD_BLOCK = 512


def diagnose_skipped_step(run: Any, step: int) -> Diagnosis | None:
    """Diagnose the batch of skipped step ``step`` of a ``train`` run.

    Args:
        run: what the training loop knows of the run. It is read, never changed:

            * ``model``: the model being trained;
            * ``strategy``: its ``tf.distribute.Strategy``;
            * ``history``: the :class:`~companion.training.TrainingHistory`, whose
              ``epoch_steps`` (steps of each completed epoch) locate the batch in its
              epoch;
            * ``distributed``: the epoch's global batches, as a ``tf.data.Dataset`` (it
              is distributed here as ``fit`` distributes it) or a distributed dataset
              (``strategy.experimental_distribute_dataset``); ``None`` if the inputs
              cannot be read again (then no diagnosis, but the exchange still runs);
            * ``cluster``: the :class:`~companion.training.cluster.Cluster` of a
              multi-worker run, or ``None``; with a cluster, every worker must call
              this function for the same step (the loop records the same skips on
              every worker, so it does);
            * ``verbose``: print the diagnosis;
            * ``shuffled`` (optional): ``fit`` shuffled the rows of arrays, so the
              step's batch is not known: the epoch's rows are scanned in their own
              order, and the diagnosis names no batch (``batch`` is ``None``);
            * ``optimizer`` (optional): its variables are restored too.

        step: index of the skipped step, counted over all epochs.

    Returns:
        The :class:`Diagnosis`, or ``None`` if the batch is finite when re-run (an
        input pipeline that reshuffles, or updates applied after the skipped step in
        the same host call, can hide it). A failure of the doctor is a warning, not a
        reason to stop training. With several workers every worker returns the same
        diagnosis, whose ``worker`` is the worker whose shard made the NaN.
    """
    position = step - sum(run.history.epoch_steps)
    found = None
    try:
        found = _diagnose_locally(run, position)
    except Exception as error:  # pragma: no cover - the doctor must never stop training
        warnings.warn(f"the NaN doctor could not diagnose step {step}: {error!r}", RuntimeWarning, stacklevel=2)
        found = None
    if run.cluster is not None:
        # Every worker reaches this exchange, whatever its own doctor found (or raised).
        try:
            found = _name_worker(run, found)
        except Exception as error:  # pragma: no cover - e.g. a lost peer: the loop sees it next
            warnings.warn(f"the NaN doctor could not name the worker of step {step}: {error!r}", RuntimeWarning,
                          stacklevel=2)
            found = None  # never one worker's own diagnosis: the workers' records must agree
    if found is not None and run.verbose:
        print(f"\ncompanion.training: step {step} skipped; the NaN doctor says:\n{found}", flush=True)
    return found


def _variables(run) -> list:
    """What the re-run may move: the model's and optimizer's variables, the global RNGs."""
    variables = list(run.model.variables) + _internal.global_random_states()
    optimizer = getattr(run, "optimizer", None)
    if optimizer is not None:
        variables += list(getattr(optimizer, "variables", ()))
    return variables


def _diagnose_locally(run, position: int) -> Diagnosis | None:
    """This worker's diagnosis of the batch at ``position``, with every variable restored."""
    if run.distributed is None:
        return None
    if run.cluster is not None and uses_own_step(run.model, None):
        # The model's own train_step makes collectives of its own (its optimizers'
        # all-reduces, its metrics' sync-on-read reads): re-run by one worker only, they
        # would wait for peers that never join them.
        return None
    with preserved(_variables(run)):
        if getattr(run, "shuffled", False) and run.cluster is None:
            # fit permuted the arrays' rows: the step's batch is not known. The first
            # non-finite batch of the rows in their own order, with no batch named.
            found = diagnose(run.model, _flat(run), jit_compile=False)
            return None if found is None else replace(found, batch=None)
        for replica, part in _local_batches(run, position):
            found = diagnose(run.model, iter([part]), jit_compile=False)
            if found is not None:
                return _with_replica(found, run, replica, position)
        if run.cluster is None:
            # The batch may have moved (a reshuffling pipeline): scan the epoch.
            return diagnose(run.model, _flat(run), jit_compile=False, max_batches=max(position + 1, 1) * 2)
    return None


def _distributed(run):
    data = run.distributed
    if isinstance(data, tf.data.Dataset) and (run.cluster is not None or run.strategy.num_replicas_in_sync > 1):
        return run.strategy.experimental_distribute_dataset(data)
    return data


def _parts(run, batch) -> list:
    """The local replicas' parts of one batch (the batch itself on one device)."""
    return list(run.strategy.experimental_local_results(batch))


def _local_batches(run, position: int):
    """The batch at ``position`` of the epoch, one part per local replica: ``[(replica, part)]``."""
    iterator = iter(_distributed(run))
    batch = None
    for _ in range(position + 1):
        batch = next(iterator)
    return list(enumerate(_parts(run, batch)))


def _flat(run):
    """Every local replica's batches, in order."""
    for batch in _distributed(run):
        yield from _parts(run, batch)


def _local_replicas(run) -> int:
    """Replicas on this worker (the strategy's replicas are spread evenly over the workers)."""
    workers = run.cluster.workers if run.cluster is not None else 1
    return max(run.strategy.num_replicas_in_sync // max(workers, 1), 1)


def _with_replica(found: Diagnosis, run, replica: int, position: int) -> Diagnosis:
    epoch = len(run.history.epoch_steps)  # the epochs completed before this one
    if _local_replicas(run) > 1:
        return replace(found, batch=position, epoch=epoch, inputs_summary=f"replica {replica}: {found.inputs_summary}")
    return replace(found, batch=position, epoch=epoch)


def _encode(found: Diagnosis | None) -> bytes:
    return b"" if found is None else json.dumps(found.to_dict(), sort_keys=True, allow_nan=True).encode()


def _name_worker(run, found: Diagnosis | None) -> Diagnosis | None:
    """Give every worker the same diagnosis: the first worker's whose shard made the NaN.

    Two all-reduces that every worker joins with the same shapes, both by
    :meth:`~companion.training.cluster.Cluster.gather` (whose one compiled function
    serves every length): (found?, length of the encoded diagnosis, identity) per
    replica, then the chosen worker's bytes (exact in float32: integers below 256).
    """
    local = _local_replicas(run)
    mine = _encode(found)
    me = _identity(run)
    rows = run.cluster.gather(1.0 if found is not None else 0.0, float(len(mine)), me)
    workers = sorted({r // local for r in range(rows.shape[0]) if rows[r, 0] > 0.5})
    if not workers:
        return None
    chosen = workers[0]
    length = int(rows[chosen * local, 1])
    width = max(PAYLOAD_BLOCK, int(math.ceil(length / PAYLOAD_BLOCK)) * PAYLOAD_BLOCK)
    payload = np.zeros(width, np.float32)
    if found is not None and rows[chosen * local, 2] == me:
        payload[: len(mine)] = np.frombuffer(mine, np.uint8)
    received = run.cluster.gather(*payload)
    data = bytes(np.rint(received[chosen * local, :length]).astype(np.uint8).tolist())
    theirs = Diagnosis.from_dict(json.loads(data.decode()))
    named = "worker " + ", ".join(str(w) for w in workers) + "'s shard made the NaN"
    return dataclasses.replace(theirs, worker=chosen, inputs_summary=f"{named}; {theirs.inputs_summary}")


def _identity(run) -> float:
    """A number no other worker has: 0 for the chief, 1 + the task id for a worker."""
    return 0.0 if run.cluster.task_type == "chief" else 1.0 + float(run.cluster.task_id)
