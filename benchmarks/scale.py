"""What do ``train``, the NaN doctor and ``SkipNonFinite`` cost as the model grows?

Four ways to train the same fresh model, from a small CNN to an MLP of 28 million weights,
against ``model.fit`` with ``keras.callbacks.TerminateOnNaN`` (Adam, batch 64, synthetic
seeded data, Keras' defaults otherwise: ``shuffle=True``, ``jit_compile="auto"``):

* ``fit``: ``compile`` + ``fit(..., callbacks=[TerminateOnNaN()])``, the reference;
* ``train``: ``companion.training.train`` with the same loss and optimizer,
  ``callbacks=[TerminateOnNaN()]``, ``verbose=0``;
* ``doctor``: ``fit`` with ``companion.diagnostics.NaNDoctor()`` next to ``TerminateOnNaN``;
* ``skip``: ``fit`` with ``companion.optimizers.SkipNonFinite(Adam())``.

Every run is a fresh Python process (this script with a hidden ``--child`` argument, which
trains one fresh model once and prints one JSON line) with a fresh model. Two runs per
measurement, of 1 and of 5 epochs, give the steady time per epoch, (T(5) - T(1)) / 4:
compiling, tracing and the first steps cancel. Memory is the growth of the process's peak
resident set (``ru_maxrss``) over the whole call of 5 epochs (read after the imports, the
model and the data are made, and after the call), in MiB and as a multiple of the bytes of
the model's trainable weights; a variant's *extra* memory is its growth minus ``fit``'s in
the same round. The variants alternate within a round (the order rotates from round to
round), and each ratio is the median over rounds of the ratio (or difference) of runs of
the same round, with its quartiles.

Targets (issue 41): ``train`` / ``fit`` <= 1.05 in steady state and ``train``'s extra memory
<= 0.25 x the weights' bytes; ``NaNDoctor`` <= 1.05 x ``fit``'s time and <= 1 x the weights'
bytes of extra memory; ``SkipNonFinite`` held to ``train``'s targets (the issue names none
of its own). Run with::

    python benchmarks/scale.py [--quick] [--rounds N] [--models NAME,...] [--json PATH]

``--json auto`` writes into ``companion/book/benchmark_results/`` under the default name.
``--quick`` (the small CNN, 1 round, 16 batches an epoch: one process running every
variant and both lengths, each on a fresh model, in 20 to 30 seconds) only checks that
the benchmark runs: its numbers are not the full run's (a run's peak memory is hidden by
the peaks of the runs before it in the process). The full run (5 models, 3 rounds, 120
processes) takes about 25 minutes on 2 cores; ``--models`` picks models, ``--batches``
sets every model's batches per epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import VERDICT_LEGEND, quartiles, ratio_line, verdict  # noqa: E402
from _results import run_child as run_child_process  # noqa: E402

BATCH = 64
EPOCHS = (1, 5)  # the two lengths whose difference gives the steady time per epoch
VARIANTS = ("fit", "train", "doctor", "skip")
NAMES = {"fit": "fit", "train": "train", "doctor": "fit + NaNDoctor", "skip": "fit + SkipNonFinite"}
# The targets of issue 41, per variant: steady time / fit's, and extra memory / weights' bytes.
TIME_TARGETS = {"train": 1.05, "doctor": 1.05, "skip": 1.05}
MEMORY_TARGETS = {"train": 0.25, "doctor": 1.0, "skip": 0.25}

#: name: (description, batches per epoch in the full run). Batches are chosen so that
#: ``fit``'s steady epoch takes one to two seconds here (2-core Xeon), the whole run ~25 min.
MODELS = {
    "cnn-bn": ("CNN with BatchNorm (28x28x1, 2 conv + BN + pooling, 10 classes)", 40),
    "mlp-0.4m": ("compute-bound MLP 256-512-512-1", 300),
    "transformer": ("Transformer encoder, 2 blocks, d = 128, sequence 32, 10 classes", 15),
    "mlp-8m": ("MLP 2048-2048-2048-1", 20),
    "mlp-28m": ("MLP 3072-3072-3072-3072-1", 8),
}
#: --quick: the small CNN, with enough batches that 4 more epochs outlast a child's noise.
QUICK_BATCHES = {"cnn-bn": 16}
#: Times a measurement is made again when its 5-epoch run was not the longer (a slow spell
#: of the shared machine during the 1-epoch run): its steady time would be 0 or negative.
RETRIES = 2
#: A full run refuses to start on a machine whose load average over the last minute is higher.
MAX_LOAD = 1.0
#: --quick runs beside other benchmarks and tests (tests/unit/test_benchmarks.py starts
#: them all at once): more chances before it gives up.
QUICK_RETRIES = 5


# --- the child: one fresh model, one call, one JSON line ------------------------------------


def build(name: str):
    """A fresh model (seeded) and its task: ``"classes"`` (10, integer labels) or ``"mse"``."""
    import keras

    keras.utils.set_random_seed(0)
    layers = keras.layers
    if name == "cnn-bn":
        model = keras.Sequential([
            keras.Input((28, 28, 1)),
            layers.Conv2D(32, 3, padding="same"), layers.BatchNormalization(), layers.ReLU(), layers.MaxPooling2D(),
            layers.Conv2D(80, 3, padding="same"), layers.BatchNormalization(), layers.ReLU(), layers.MaxPooling2D(),
            layers.Flatten(), layers.Dense(10),
        ], name=name)
        task = "classes"
    elif name == "transformer":
        tokens = keras.Input((32,), dtype="int32")
        h = layers.Embedding(2000, 128)(tokens)
        h = position_embedding(32, 128)(h)
        for _ in range(2):
            attention = layers.MultiHeadAttention(num_heads=4, key_dim=32)(h, h)
            h = layers.LayerNormalization()(h + attention)
            ffn = layers.Dense(128)(layers.Dense(512, activation="relu")(h))
            h = layers.LayerNormalization()(h + ffn)
        model = keras.Model(tokens, layers.Dense(10)(layers.GlobalAveragePooling1D()(h)), name=name)
        task = "classes"
    else:
        features, width, depth = {"mlp-0.4m": (256, 512, 2), "mlp-8m": (2048, 2048, 2),
                                  "mlp-28m": (3072, 3072, 3)}[name]
        model = keras.Sequential(
            [keras.Input((features,))] + [layers.Dense(width, activation="relu") for _ in range(depth)]
            + [layers.Dense(1)], name=name)
        task = "mse"
    return model, task


def position_embedding(length: int, width: int):
    """A learned position embedding added to the tokens' (a layer made on first use)."""
    import keras

    class _PositionEmbedding(keras.layers.Layer):
        def build(self, shape):
            self.positions = self.add_weight(shape=(length, width), initializer="uniform", name="positions")

        def call(self, x):
            return x + self.positions

    return _PositionEmbedding()


def make_data(name: str, rows: int):
    import numpy as np

    rng = np.random.default_rng(0)
    if name == "cnn-bn":
        x = rng.normal(size=(rows, 28, 28, 1)).astype("float32")
        return x, rng.integers(0, 10, size=(rows,)).astype("int32")
    if name == "transformer":
        x = rng.integers(0, 2000, size=(rows, 32)).astype("int32")
        return x, (x[:, 0] % 10).astype("int32")
    features = {"mlp-0.4m": 256, "mlp-8m": 2048, "mlp-28m": 3072}[name]
    x = rng.normal(size=(rows, features)).astype("float32")
    w = rng.normal(size=(features, 1)).astype("float32") / np.sqrt(features)
    return x, np.tanh(x @ w)


def call(variant: str, model, x, y, loss, epochs: int):
    """One call of ``variant`` on a fresh ``model`` (its History): ``fit`` with
    ``TerminateOnNaN``, ``train`` with it, or ``fit`` with ``NaNDoctor`` or ``SkipNonFinite``."""
    import keras

    from companion.diagnostics import NaNDoctor
    from companion.optimizers import SkipNonFinite
    from companion.training import train

    callbacks = [keras.callbacks.TerminateOnNaN()]
    if variant == "train":
        return train(model, x, y, batch_size=BATCH, epochs=epochs, loss=loss, optimizer=keras.optimizers.Adam(),
                     callbacks=callbacks, verbose=0)
    optimizer = SkipNonFinite(keras.optimizers.Adam()) if variant == "skip" else keras.optimizers.Adam()
    model.compile(optimizer=optimizer, loss=loss)
    if variant == "doctor":
        callbacks.append(NaNDoctor())
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=callbacks)


def child(name: str, variant: str, epochs: int, batches: int) -> dict:
    """Train a fresh ``name`` model for ``epochs`` epochs of ``batches`` batches with ``variant``."""
    import resource

    import keras
    import numpy as np

    model, kind = build(name)
    x, y = make_data(name, batches * BATCH)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True) if kind == "classes" else "mse"
    weights_bytes = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.trainable_weights)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    wall, cpu = time.perf_counter(), time.process_time()
    history = call(variant, model, x, y, loss, epochs)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    losses = history.history.get("loss", [])
    return {
        "model": name, "variant": variant, "epochs": epochs, "batches": batches,
        "seconds": wall, "cpu_seconds": cpu, "growth_mib": (after - before) / 1024,
        "weights_bytes": weights_bytes, "params": int(model.count_params()),
        "completed": len(losses) == epochs and all(np.isfinite(losses)),
    }


# --- the parent: rounds of fresh processes --------------------------------------------------


def run_child(name: str, variant: str, epochs: int, batches: int) -> dict:
    return run_child_process(
        __file__, name, variant, str(epochs), str(batches), what=f"{name}, {variant}, {epochs} epochs",
        incomplete="did not end all its epochs with a finite loss: its time is not a steady epoch's",
    )


def run_all_in_one_child(name: str, batches: int, order: tuple[str, ...]) -> dict:
    """--quick: every variant and both lengths in one fresh process, each run on a fresh
    model ({variant: {epochs: result}}). One process instead of a full round's eight; a
    run's memory is not its own (the peak of an earlier run in the process hides it)."""
    found = run_child_process(__file__, name, ",".join(order), ",".join(map(str, EPOCHS)), str(batches),
                              what=f"{name}, {', '.join(order)}, {' and '.join(map(str, EPOCHS))} epochs")
    timed: dict = {}
    for result in found["lengths"]:
        if not result["completed"]:
            raise RuntimeError(f"the run of {name}, {result['variant']}, {result['epochs']} epochs did not end all "
                               "its epochs with a finite loss: its time is not a steady epoch's")
        timed.setdefault(result["variant"], {})[result["epochs"]] = result
    return timed


def _longer(timed: dict) -> bool:
    """Whether the run of more epochs took longer, in wall and in CPU time."""
    short, long = timed[EPOCHS[0]], timed[EPOCHS[1]]
    return long["seconds"] > short["seconds"] and long["cpu_seconds"] > short["cpu_seconds"]


def _row(timed: dict) -> dict:
    short, long = timed[EPOCHS[0]], timed[EPOCHS[1]]
    span = EPOCHS[1] - EPOCHS[0]
    return {
        "t1": short["seconds"], "t5": long["seconds"],
        "steady": (long["seconds"] - short["seconds"]) / span,
        "cpu_steady": (long["cpu_seconds"] - short["cpu_seconds"]) / span,
        "growth_mib": long["growth_mib"], "growth_mib_1_epoch": short["growth_mib"],
    }


def measure(name: str, batches: int, rounds: int, retries: int = RETRIES, one_process: bool = False) -> dict:
    """{variant: [per-round {"t1", "t5", "steady", "cpu_steady", "growth_mib"}]} and the model's size.

    ``one_process`` (--quick): every variant and both lengths in one process."""
    runs = {variant: [] for variant in VARIANTS}
    size = None
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
        if one_process:
            for attempt in range(retries + 1):
                again = f" (again: {attempt + 1})" if attempt else ""
                print(f"  {name}: {', '.join(NAMES[v] for v in order)}, {' and '.join(map(str, EPOCHS))} epochs of "
                      f"{batches} batches in one process{again}", file=sys.stderr, flush=True)
                every = run_all_in_one_child(name, batches, order)
                if all(_longer(every[variant]) for variant in order):
                    break
                print(f"  {name}: a run of {EPOCHS[1]} epochs was not the longer: measured again", file=sys.stderr,
                      flush=True)
            else:
                raise RuntimeError(f"{name}: {EPOCHS[1]} epochs never took longer than {EPOCHS[0]} for every "
                                   "variant: give it more batches (--batches)")
            for variant in order:
                runs[variant].append(_row(every[variant]))
            long = every[order[0]][EPOCHS[1]]
            size = size or {"params": long["params"], "weights_bytes": long["weights_bytes"]}
            continue
        for variant in order:
            for attempt in range(retries + 1):
                again = f" (again: {attempt + 1})" if attempt else ""
                timed = {}
                # Which length runs first alternates too (a slow spell of the machine hits both).
                for epochs in (EPOCHS if (r + VARIANTS.index(variant)) % 2 == 0 else EPOCHS[::-1]):
                    print(f"  {name}, round {r + 1}/{rounds}: {NAMES[variant]}, {epochs} "
                          f"epoch{'s' * (epochs > 1)} of {batches} batches{again}", file=sys.stderr, flush=True)
                    timed[epochs] = run_child(name, variant, epochs, batches)
                if _longer(timed):
                    break
                print(f"  {name}, {NAMES[variant]}: {EPOCHS[1]} epochs took {timed[EPOCHS[1]]['seconds']:.2f} s, "
                      f"{EPOCHS[0]} took {timed[EPOCHS[0]]['seconds']:.2f} s: measured again", file=sys.stderr,
                      flush=True)
            else:
                raise RuntimeError(f"{name}, {NAMES[variant]}: {EPOCHS[1]} epochs never took longer than "
                                   f"{EPOCHS[0]}: give it more batches (--batches)")
            long = timed[EPOCHS[1]]
            size = size or {"params": long["params"], "weights_bytes": long["weights_bytes"]}
            runs[variant].append(_row(timed))
    return {"runs": runs, **size, "batches": batches}


def summarise(name: str, measured: dict) -> list[dict]:
    """The ratios of one model: each variant's steady time / fit's, its extra memory / the weights' bytes."""
    runs, weights_mib = measured["runs"], measured["weights_bytes"] / 2**20
    rows = []
    for variant in VARIANTS[1:]:
        pairs = list(zip(runs[variant], runs["fit"]))
        times = [v["steady"] / f["steady"] for v, f in pairs]
        cpus = [v["cpu_steady"] / f["cpu_steady"] for v, f in pairs]
        extras = [v["growth_mib"] - f["growth_mib"] for v, f in pairs]
        q1, median, q3 = quartiles(times)
        rows.append(dict(
            label=f"scale, {name}: {NAMES[variant]} / fit (steady time)", ratio=round(median, 4),
            q1=round(q1, 4), q3=round(q3, 4), target=TIME_TARGETS[variant], rounds=len(pairs),
            cpu_ratio=round(statistics.median(cpus), 4), model=name, variant=variant, kind="time",
            params=measured["params"], weights_mib=round(weights_mib, 3),
        ))
        e1, extra, e3 = quartiles(extras)
        rows.append(dict(
            label=f"scale, {name}: {NAMES[variant]} extra memory / weights' bytes",
            ratio=round(extra / weights_mib, 4), q1=round(e1 / weights_mib, 4), q3=round(e3 / weights_mib, 4),
            target=MEMORY_TARGETS[variant], rounds=len(pairs), extra_mib=round(extra, 2),
            fit_growth_mib=round(statistics.median(f["growth_mib"] for f in runs["fit"]), 2),
            model=name, variant=variant, kind="memory", params=measured["params"],
            weights_mib=round(weights_mib, 3),
        ))
    return rows


def print_table(results: dict, rows: list[dict]) -> None:
    """One line per model: its size, fit's steady epoch and memory growth, each variant's costs."""
    by = {(row["model"], row["variant"], row["kind"]): row for row in rows}
    mark = {"met": " ", "missed": "!", "not resolved": "?"}
    print(f"{'':<12}{'weights':>17}{'fit':>16}" + "".join(f"{NAMES[v]:>31}" for v in VARIANTS[1:]))
    print(f"{'model':<12}{'M':>7}{'MiB':>10}{'s/epoch':>8}{'growth':>8}"
          + f"{'time':>9}{'extra memory':>22}" * len(VARIANTS[1:]))
    for name, measured in results.items():
        fit = measured["runs"]["fit"]
        line = (f"{name:<12}{measured['params'] / 1e6:>7.2f}{measured['weights_bytes'] / 2**20:>10.1f}"
                f"{statistics.median(r['steady'] for r in fit):>8.2f}"
                f"{statistics.median(r['growth_mib'] for r in fit):>8.0f}")
        for variant in VARIANTS[1:]:
            t, m = by[(name, variant, "time")], by[(name, variant, "memory")]
            line += (f"{t['ratio']:>8.2f}{mark[verdict(t['q1'], t['q3'], t['target'])]}"
                     f"{m['extra_mib']:>+9.0f} MiB{m['ratio']:>7.2f}x{mark[verdict(m['q1'], m['q3'], m['target'])]}")
        print(line)
    print("time: steady time per epoch / fit's; extra memory: peak-memory growth over fit's, in MiB and x the"
          " weights' bytes;\nfit: its steady seconds per epoch and its peak-memory growth in MiB;"
          " ! target missed, ? not resolved (the rounds straddle it)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{', '.join(QUICK_BATCHES)}, 1 round, few batches an epoch (a smoke test)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--batches", type=int, help="batches per epoch for every model (default: each model's own)")
    parser.add_argument("--json", metavar="PATH", help="also write the ratios as JSON ('auto': the default name)")
    parser.add_argument("--allow-load", action="store_true",
                        help=f"measure even if the load average is over {MAX_LOAD} (the results say so)")
    parser.add_argument("--child", nargs=4, metavar=("MODEL", "VARIANTS", "EPOCHS", "BATCHES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        name, variants, epochs, batches = args.child
        lengths = [child(name, variant, int(e), int(batches)) for variant in variants.split(",")
                   for e in epochs.split(",")]
        print(json.dumps(lengths[0] if len(lengths) == 1 else {"lengths": lengths}), flush=True)
        return 0

    names = args.models.split(",") if args.models else list(QUICK_BATCHES if args.quick else MODELS)
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; there are {list(MODELS)}")
    rounds = 1 if args.quick else args.rounds
    load = os.getloadavg()[0]
    if not args.quick and load > MAX_LOAD and not args.allow_load:
        # Its ratios compare runs made minutes apart: another job's load lands on some of them.
        print(f"the machine is busy (load average {load:.1f} over the last minute, more than {MAX_LOAD}): "
              f"measure on a quiet machine, or pass --allow-load", file=sys.stderr)
        return 2
    where = ("--quick: every run in one process, each on a fresh model (a smoke run: not the full run's numbers)"
             if args.quick
             else "every run a fresh process and a fresh model")
    print(f"{rounds} round{'s' * (rounds > 1)}, {where}; batch {BATCH}, "
          f"steady time per epoch = (T({EPOCHS[1]} epochs) - T({EPOCHS[0]})) / {EPOCHS[1] - EPOCHS[0]}", flush=True)
    results, rows = {}, []
    started = time.perf_counter()
    for name in names:
        batches = args.batches or (QUICK_BATCHES.get(name, 2) if args.quick else MODELS[name][1])
        results[name] = measure(name, batches, rounds, QUICK_RETRIES if args.quick else RETRIES,
                                one_process=args.quick)
        model_rows = summarise(name, results[name])
        rows += model_rows
        print(f"\n{name}: {MODELS[name][0]}, {results[name]['params'] / 1e6:.2f} M weights "
              f"({results[name]['weights_bytes'] / 2**20:.1f} MiB), {batches} batches an epoch", flush=True)
        for row in model_rows:
            extra = f", {row['extra_mib']:+.1f} MiB" if row["kind"] == "memory" else f", CPU {row['cpu_ratio']:.2f}"
            print(ratio_line(row, 66, extra), flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s")
    print_table(results, rows)
    print(VERDICT_LEGEND)
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _results import write_results

        models = {name: {"description": MODELS[name][0], "params": r["params"], "weights_bytes": r["weights_bytes"],
                         "batches": r["batches"], "batch_size": BATCH, "runs": r["runs"]}
                  for name, r in results.items()}
        write_results(args.json, "scale", rows, extra={
            "models": models, "epochs": list(EPOCHS),
            # The load when the run started (the file's load_average is the one at its end).
            "load_at_start": round(load, 2), "allow_load": bool(args.allow_load)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
