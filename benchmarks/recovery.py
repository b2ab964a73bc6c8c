"""What do rollback and loss-spike skipping cost a run that needs neither?

``train(..., on_nonfinite="rollback", skip_loss_spikes=6)`` against ``train()`` with its
defaults, on the same fresh model, seeded data with no NaN and no spike (Adam, batch 64,
``verbose=0``, Keras' defaults otherwise), side by side in one run:

* ``train``: ``companion.training.train(model, x, y, ...)``, the reference;
* ``recover``: the same call with ``on_nonfinite="rollback", skip_loss_spikes=6``: the
  running mean and variance of the loss and the spike test in every step, the host's count
  of non-finite runs after every host call, and the snapshot of the state (weights and
  optimizer state, on the host) at every epoch's start and every
  ``companion.training.recovery.SNAPSHOT_EVERY_STEPS`` steps.

Every run is a fresh Python process (this script with a hidden ``--child`` argument, which
trains one fresh model once, for 6 epochs, and prints one JSON line), the models and data of
``benchmarks/scale.py``. The steady time per epoch is the median of the wall (and CPU) times
of epochs 1 to 5, each one host call, timed by a callback from its start to its end: the
first epoch's compiling and tracing are left out, and a slow spell of the shared machine
moves one epoch, not the median. Memory is the growth of the process's peak resident set
(``ru_maxrss``) over the call; ``recover``'s *extra* memory is its growth minus ``train``'s in the same round, as
a multiple of the bytes of the state a rollback restores (every variable of the model and
of the optimizer: for Adam, the weights and two moments). The variants alternate within a
round (the order rotates from round to round), and each ratio is the median over rounds of
the ratio (or difference) of the runs of the same round, with its quartiles.

Targets (issue 46): ``recover`` / ``train`` <= 1.05 in steady state; its memory one snapshot
of the state it restores: extra memory <= 1 x the state's bytes. Run with::

    python benchmarks/recovery.py [--quick] [--rounds N] [--models NAME,...] [--json PATH]

``--json auto`` writes into ``companion/book/benchmark_results/`` under the default name.
``--quick`` (the smaller MLP, 1 round, a few batches an epoch: both variants in one
process, each on a fresh model) only checks that the benchmark runs: its numbers are not
the full run's (``recover``'s peak memory is hidden by ``train``'s before it in the
process). The full run (2 models, 5 rounds, 20 processes) takes about 6 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _results import VERDICT_LEGEND, quartiles, ratio_line  # noqa: E402
from _results import run_child as run_child_process  # noqa: E402
from scale import BATCH, build, make_data  # noqa: E402

EPOCHS = 6  # epoch 0 compiles; the steady time is the median of epochs 1 to 5

VARIANTS = ("train", "recover")
NAMES = {"train": "train()", "recover": "train(rollback, spikes)"}
OPTIONS = {"train": {}, "recover": {"on_nonfinite": "rollback", "skip_loss_spikes": 6}}
TIME_TARGET = 1.05  # recover / train, steady time
MEMORY_TARGET = 1.0  # recover's extra peak memory / the bytes of the state it restores

#: name: (description, batches per epoch in the full run): a model whose step is short
#: (where a per-step cost shows) and one whose state is large (where the snapshot shows).
MODELS = {
    "mlp-0.4m": ("compute-bound MLP 256-512-512-1", 300),
    "mlp-8m": ("MLP 2048-2048-2048-1", 20),
}
QUICK_BATCHES = {"mlp-0.4m": 20}


# --- the child: one fresh model, one call, one JSON line ------------------------------------


def child(name: str, variant: str, epochs: int, batches: int) -> dict:
    """Train a fresh ``name`` model for ``epochs`` epochs of ``batches`` batches with ``variant``."""
    import resource

    import keras
    import numpy as np

    from companion.training import train

    class EpochTimes(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.wall, self.cpu = [], []

        def on_epoch_begin(self, epoch, logs=None):
            self.started = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            self.wall.append(time.perf_counter() - self.started[0])
            self.cpu.append(time.process_time() - self.started[1])

    model, kind = build(name)
    x, y = make_data(name, batches * BATCH)
    optimizer = keras.optimizers.Adam()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True) if kind == "classes" else "mse"
    timer = EpochTimes()  # epoch hooks only: train still runs an epoch per host call
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    history = train(model, x, y, batch_size=BATCH, epochs=epochs, loss=loss, optimizer=optimizer, verbose=0,
                    callbacks=[timer], **OPTIONS[variant])
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    rate = id(getattr(optimizer, "_learning_rate", None))
    state = [*model.variables, *(v for v in optimizer.variables if id(v) != rate)]
    state_bytes = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in state)
    return {
        "model": name, "variant": variant, "epochs": epochs, "batches": batches,
        "epoch_seconds": timer.wall, "epoch_cpu_seconds": timer.cpu,
        "steady": statistics.median(timer.wall[1:]), "cpu_steady": statistics.median(timer.cpu[1:]),
        "growth_mib": (after - before) / 1024, "state_bytes": state_bytes, "params": int(model.count_params()),
        "completed": len(history.epoch_loss) == epochs and bool(np.isfinite(history.epoch_loss).all())
        and not history.skipped and not history.rollbacks,
    }


# --- the parent: rounds of fresh processes --------------------------------------------------


def run_child(name: str, variant: str, epochs: int, batches: int) -> dict:
    return run_child_process(
        __file__, name, variant, str(epochs), str(batches), what=f"{name}, {variant}, {epochs} epochs",
        incomplete="skipped or rolled back a step, or did not end all its epochs with a finite loss: "
        "it is not the clean run measured here",
    )


def run_all_in_one_child(name: str, order: tuple[str, ...], batches: int) -> list[dict]:
    """--quick: every variant in one fresh process, each on a fresh model, in ``order`` (a
    run's memory is not its own: an earlier run's peak hides it)."""
    found = run_child_process(__file__, name, ",".join(order), str(EPOCHS), str(batches),
                              what=f"{name}, {', '.join(order)}, {EPOCHS} epochs")
    for run in found["variants"]:
        if not run["completed"]:
            raise RuntimeError(f"the run of {name}, {run['variant']} skipped or rolled back a step, or did not end "
                               "all its epochs with a finite loss: it is not the clean run measured here")
    return found["variants"]


def measure(name: str, batches: int, rounds: int, one_process: bool = False) -> dict:
    """{variant: [per-round {"steady", "cpu_steady", "growth_mib", "epoch_seconds"}]} and the state's size.

    ``one_process`` (--quick): every variant in one process."""
    runs = {variant: [] for variant in VARIANTS}
    size = None
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
        if one_process:
            print(f"  {name}: {', '.join(NAMES[v] for v in order)}, {EPOCHS} epochs of {batches} batches in one "
                  "process", file=sys.stderr, flush=True)
            found = run_all_in_one_child(name, order, batches)
        else:
            found = []
            for variant in order:
                print(f"  {name}, round {r + 1}/{rounds}: {NAMES[variant]}, {EPOCHS} epochs of {batches} batches",
                      file=sys.stderr, flush=True)
                found.append(run_child(name, variant, EPOCHS, batches))
        for variant, run in zip(order, found):
            size = size or {"params": run["params"], "state_bytes": run["state_bytes"]}
            runs[variant].append({key: run[key] for key in ("steady", "cpu_steady", "growth_mib", "epoch_seconds")})
    return {"runs": runs, **size, "batches": batches}


def summarise(name: str, measured: dict) -> list[dict]:
    """recover's steady time / train's, and its extra peak memory / the state's bytes."""
    runs, state_mib = measured["runs"], measured["state_bytes"] / 2**20
    pairs = list(zip(runs["recover"], runs["train"]))
    times = [v["steady"] / f["steady"] for v, f in pairs]
    cpus = [v["cpu_steady"] / f["cpu_steady"] for v, f in pairs]
    extras = [v["growth_mib"] - f["growth_mib"] for v, f in pairs]
    q1, median, q3 = quartiles(times)
    e1, extra, e3 = quartiles(extras)
    common = dict(model=name, rounds=len(pairs), params=measured["params"], state_mib=round(state_mib, 3))
    return [
        dict(label=f"recovery, {name}: train(rollback, spikes) / train() (steady time)", ratio=round(median, 4),
             q1=round(q1, 4), q3=round(q3, 4), target=TIME_TARGET, kind="time",
             cpu_ratio=round(statistics.median(cpus), 4), **common),
        dict(label=f"recovery, {name}: train(rollback, spikes) extra memory / state's bytes",
             ratio=round(extra / state_mib, 4), q1=round(e1 / state_mib, 4), q3=round(e3 / state_mib, 4),
             target=MEMORY_TARGET, kind="memory", extra_mib=round(extra, 2),
             train_growth_mib=round(statistics.median(f["growth_mib"] for f in runs["train"]), 2), **common),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{', '.join(QUICK_BATCHES)}, 1 round, few batches an epoch (a smoke test)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--batches", type=int, help="batches per epoch for every model (default: each model's own)")
    parser.add_argument("--json", metavar="PATH", help="also write the ratios as JSON ('auto': the default name)")
    parser.add_argument("--child", nargs=4, metavar=("MODEL", "VARIANTS", "EPOCHS", "BATCHES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        name, variants, epochs, batches = args.child
        found = [child(name, variant, int(epochs), int(batches)) for variant in variants.split(",")]
        print(json.dumps(found[0] if len(found) == 1 else {"variants": found}), flush=True)
        return 0

    names = args.models.split(",") if args.models else list(QUICK_BATCHES if args.quick else MODELS)
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; there are {list(MODELS)}")
    rounds = 1 if args.quick else args.rounds
    where = ("--quick: every run in one process, each on a fresh model (a smoke run: not the full run's numbers)"
             if args.quick
             else "every run a fresh process and a fresh model")
    print(f"{rounds} round{'s' * (rounds > 1)}, {where}; batch {BATCH}, "
          f"steady time per epoch = the median of epochs 1 to {EPOCHS - 1}'s", flush=True)
    results, rows = {}, []
    started = time.perf_counter()
    for name in names:
        batches = args.batches or (QUICK_BATCHES.get(name, 4) if args.quick else MODELS[name][1])
        results[name] = measure(name, batches, rounds, one_process=args.quick)
        model_rows = summarise(name, results[name])
        rows += model_rows
        print(f"\n{name}: {MODELS[name][0]}, {results[name]['params'] / 1e6:.2f} M weights, state "
              f"{results[name]['state_bytes'] / 2**20:.1f} MiB, {batches} batches an epoch", flush=True)
        for row in model_rows:
            extra = f", {row['extra_mib']:+.1f} MiB" if row["kind"] == "memory" else f", CPU {row['cpu_ratio']:.2f}"
            print(ratio_line(row, 72, extra), flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s")
    print(VERDICT_LEGEND)
    if args.json:
        from _results import write_results

        models = {name: {"description": MODELS[name][0], "params": r["params"], "state_bytes": r["state_bytes"],
                         "batches": r["batches"], "batch_size": BATCH, "runs": r["runs"]}
                  for name, r in results.items()}
        write_results(args.json, "recovery", rows, extra={"models": models, "epochs": EPOCHS})
    return 0


if __name__ == "__main__":
    sys.exit(main())
