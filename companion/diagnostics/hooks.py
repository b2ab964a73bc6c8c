"""The diagnosis of the first step :func:`companion.training.train` skips.

:func:`diagnose_skipped_step` is called by the training loop once, when it records its
first skipped step, and never on a step that applied its update, so the doctor costs
nothing while training is clean. It re-reads the step's batch from the training data
(the same batch if the input pipeline is deterministic; else it scans the epoch) and
diagnoses it with the model's weights, which a skipped step left unchanged. Under a
distribution strategy each replica's part of the batch is diagnosed, and with several
workers the workers exchange one number each, so every worker (and the chief's report)
names the worker whose shard made the NaN.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from companion.diagnostics.causes import CAUSES
from companion.diagnostics.doctor import PHASES, Diagnosis, diagnose

__all__ = ["diagnose_skipped_step"]


def _local_batches(run, position: int):
    """The batch at ``position`` of the epoch, one per local replica: ``[(replica, batch)]``."""
    strategy = run.strategy
    iterator = iter(run.distributed)
    batch = None
    for _ in range(position + 1):
        batch = next(iterator)
    parts = strategy.experimental_local_results(batch)
    return list(enumerate(parts))


def diagnose_skipped_step(run: Any, step: int) -> Diagnosis | None:
    """Diagnose the batch of skipped step ``step`` of a ``train`` run.

    Args:
        run: the training loop's state (``companion.training.prepare.Run``).
        step: index of the skipped step, counted over all epochs.

    Returns:
        The :class:`Diagnosis`, or ``None`` if the batch is finite when re-run (an
        input pipeline that reshuffles, or updates applied after the skipped step in
        the same host call, can hide it). A failure of the doctor is a warning, not a
        reason to stop training; with several workers, every worker still takes part
        in the one exchange that names the worker (its failure would else hang the
        others).
    """
    position = step - sum(run.history.epoch_steps)
    found = None
    try:
        for replica, part in _local_batches(run, position):
            found = diagnose(run.model, iter([part]), jit_compile=False)
            if found is not None:
                found = _with_replica(found, run, replica, position)
                break
        if found is None and run.cluster is None:
            # The batch may have moved (a reshuffling pipeline): scan the epoch.
            found = diagnose(run.model, _flat(run), jit_compile=False, max_batches=max(position + 1, 1) * 2)
    except Exception as error:  # pragma: no cover - the doctor must never stop training
        warnings.warn(f"the NaN doctor could not diagnose step {step}: {error!r}", RuntimeWarning, stacklevel=2)
        found = None
    if run.cluster is not None:
        # Every worker reaches this exchange, whatever its own doctor found (or raised).
        try:
            found = _name_worker(run, found, position)
        except Exception as error:  # pragma: no cover - e.g. a lost peer: the loop sees it next
            warnings.warn(f"the NaN doctor could not name the worker of step {step}: {error!r}", RuntimeWarning,
                          stacklevel=2)
    if found is not None and run.verbose:
        print(f"\ncompanion.training: step {step} skipped; the NaN doctor says:\n{found}", flush=True)
    return found


def _flat(run):
    """Every local replica's batches, in order."""
    for batch in run.distributed:
        yield from run.strategy.experimental_local_results(batch)


def _with_replica(found: Diagnosis, run, replica: int, position: int) -> Diagnosis:
    if run.strategy.num_replicas_in_sync > 1:
        return dataclasses.replace(found, batch=position, inputs_summary=f"replica {replica}: {found.inputs_summary}")
    return dataclasses.replace(found, batch=position)


def _name_worker(run, found: Diagnosis | None, position: int) -> Diagnosis | None:
    """Tell every worker which worker's shard made the NaN (one small all-reduce)."""
    causes = list(CAUSES)
    mine = (
        (1.0, float(causes.index(found.cause)), float(PHASES.index(found.phase)))
        if found is not None
        else (0.0, 0.0, 0.0)
    )
    rows = run.cluster.gather(*mine)
    local = max(len(run.strategy.experimental_local_results(run.runner.variables[0])), 1)
    workers = sorted({r // local for r in range(rows.shape[0]) if rows[r, 0] > 0.5})
    if not workers:
        return found
    named = "worker " + ", ".join(str(w) for w in workers) + "'s shard made the NaN"
    if found is not None:
        return dataclasses.replace(found, worker=workers[0], inputs_summary=f"{named}; {found.inputs_summary}")
    row = rows[workers[0] * local]
    cause = causes[int(row[1])]
    return Diagnosis(
        batch=position, phase=PHASES[int(row[2])], op=None, forward_op=None, layer=None, source=None,
        variables=(), dtype=None, inputs_summary=f"{named} (its own log has the full diagnosis)",
        cause=cause, fix=CAUSES[cause].fix, section=CAUSES[cause].section, worker=workers[0],
    )
