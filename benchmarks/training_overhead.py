"""What does the guarded training loop cost?

Prints, from alternating runs in one process (medians of several repeats):

1. ``companion.training.train`` against ``model.fit`` (both with Keras' default
   ``jit_compile="auto"``: no XLA on a CPU) with ``keras.callbacks.TerminateOnNaN``,
   on the same model, data and number of epochs:
   a small MLP (where per-step overhead dominates; target ratio <= 0.5) and a
   compute-bound MLP (where the matrix products dominate; target <= 1.05);
2. ``train`` with its finiteness guard on against the same loop with the guard off
   (``train(..., on_nonfinite="ignore")``, which applies every step unchecked, as ``fit`` does; it exists for
   this measurement); target <= 1.03.

Each configuration is compiled once before timing (``train`` keeps its compiled step
per model, as ``fit`` keeps its ``train_function``), so the numbers are steady-state
training time. The runs cycle through all orders, and each ratio is the median of the
ratios of runs made in the same round: the speed of a small shared VM drifts (and
sometimes halves for seconds), which medians of raw times alone do not cancel. Two
more estimates are printed next to it: the ratio of the fastest runs (a slowdown from
outside never makes a run faster) and the ratio of process CPU time (a core lost to
another tenant does not add CPU time). Run with::

    python benchmarks/training_overhead.py [--quick] [--json PATH]

(``--json`` also writes the ratios for the book's performance page; ``--quick``, 2 rounds
of each on less data and a 128-wide "compute-bound" model, only checks that the benchmark
runs: its ratios are not the full run's.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

from _results import ratio, rounds, write_results

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from companion.training import train  # noqa: E402


def make_data(n: int, features: int, batch: int) -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, 1)).astype("float32") / np.sqrt(features)
    y = np.tanh(x @ w)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).cache()


def make_model(features: int, width: int, depth: int, seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((features,))]
    layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    layers.append(keras.layers.Dense(1))
    return keras.Sequential(layers)


PAIRS = {
    "train/fit": ("train", "fit"),
    "guard on/off": ("train", "train_unguarded"),
    "train/fit with callbacks": ("train_callbacks", "fit_callbacks"),
}


def typical_callbacks(directory: str) -> list:
    """EarlyStopping + ModelCheckpoint + CSVLogger: what a training script typically passes."""
    return [
        keras.callbacks.EarlyStopping("loss", patience=100),
        keras.callbacks.ModelCheckpoint(os.path.join(directory, "model.keras")),
        keras.callbacks.CSVLogger(os.path.join(directory, "log.csv"), append=True),
    ]


def compare(
    name: str, data, features: int, width: int, depth: int, epochs: int, repeats: int, warmups: int = 2
) -> dict[str, dict]:
    """Times fit / train / unguarded train in rounds; returns the ratios of PAIRS."""
    loss = keras.losses.MeanSquaredError()
    fit_model = make_model(features, width, depth)
    fit_model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    guarded_model, guarded_opt = make_model(features, width, depth), keras.optimizers.Adam(1e-3)
    open_model, open_opt = make_model(features, width, depth), keras.optimizers.Adam(1e-3)

    directory = tempfile.mkdtemp(prefix="training_overhead-")
    fit_cb_model = make_model(features, width, depth)
    fit_cb_model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    train_cb_model, train_cb_opt = make_model(features, width, depth), keras.optimizers.Adam(1e-3)

    runs = {
        "fit": lambda: fit_model.fit(
            data, epochs=epochs, verbose=0, shuffle=False, callbacks=[keras.callbacks.TerminateOnNaN()]
        ),
        "train": lambda: train(
            guarded_model, data, loss=loss, optimizer=guarded_opt, epochs=epochs, verbose=0, callbacks=[]
        ),
        "train_unguarded": lambda: train(
            open_model, data, loss=loss, optimizer=open_opt, epochs=epochs, verbose=0, on_nonfinite="ignore"
        ),
        "fit_callbacks": lambda: fit_cb_model.fit(
            data, epochs=epochs, verbose=0, shuffle=False, callbacks=typical_callbacks(directory)
        ),
        "train_callbacks": lambda: train(
            train_cb_model, data, loss=loss, optimizer=train_cb_opt, epochs=epochs, verbose=0,
            callbacks=typical_callbacks(directory),
        ),
    }
    for run in runs.values():  # compile, and let train() settle its steps per host call
        for _ in range(warmups):
            run()
    # Rounds through all orders, so that each run follows each other run equally often.
    wall, cpu = rounds(runs, repeats)

    steps = int(data.cardinality()) * epochs
    print(f"\n{name}: {steps} steps per run ({epochs} epoch), {repeats} rounds")
    print(f"  {'run':<16} {'median wall':>12} {'ms/step':>8} {'fastest':>8} {'median CPU':>11}")
    for key in runs:
        median = statistics.median(wall[key])
        print(
            f"  {key:<16} {median:11.3f}s {1e3 * median / steps:8.3f} {min(wall[key]):7.3f}s"
            f" {statistics.median(cpu[key]):10.3f}s"
        )
    # Ratios of runs of the same round cancel slow drifts of the machine's speed.
    results = {label: ratio(wall, cpu, top, bottom) for label, (top, bottom) in PAIRS.items()}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of each: a smoke test (seconds)")
    parser.add_argument("--json", metavar="PATH", help="also write the ratios as JSON to PATH")
    args = parser.parse_args()
    # Many short runs: this 2-core VM's speed drifts by +-20 % from second to second.
    repeats_small, repeats_big = (2, 2) if args.quick else (42, 24)
    rows_small, big_width, big_batches = (1024, 128, 2) if args.quick else (8192, 1024, 8)

    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, {os.cpu_count()} CPU cores, no GPU")
    small = compare(
        "small MLP (32 -> 64 -> 64 -> 1, batch 64)",
        make_data(rows_small, 32, 64),
        features=32,
        width=64,
        depth=2,
        epochs=1,
        repeats=repeats_small,
        warmups=1 if args.quick else 2,
    )
    big = compare(
        f"compute-bound MLP ({big_width} -> {big_width} -> {big_width} -> 1, batch 256)",
        make_data(256 * big_batches, big_width, 256),
        features=big_width,
        width=big_width,
        depth=2,
        epochs=1,
        repeats=repeats_big,
        warmups=1 if args.quick else 2,
    )

    print(
        "\nRatios, lower is better. 'wall' (the verdict) is the median of the wall-clock ratios of runs in\n"
        "the same round; 'fastest' compares the fastest runs; 'CPU' is the median ratio of process CPU time,\n"
        "which a core lost to other tenants does not inflate."
    )
    rows = [
        ("small MLP: train / fit+TerminateOnNaN", small["train/fit"], 0.5),
        ("small MLP, EarlyStopping+ModelCheckpoint+CSVLogger: train / fit", small["train/fit with callbacks"], 1.0),
        ("compute-bound: train / fit+TerminateOnNaN", big["train/fit"], 1.05),
        ("small MLP: train guard on / guard off", small["guard on/off"], 1.03),
        ("compute-bound: train guard on / guard off", big["guard on/off"], 1.03),
    ]
    for label, result, target in rows:
        verdict = "ok" if result["wall"] <= target else "MISSED"
        q1, q3 = result["quartiles"]
        print(
            f"  {label:<64} wall {result['wall']:5.3f}x (target <= {target:.2f}x: {verdict:<6})"
            f"  quartiles {q1:.2f}..{q3:.2f}  fastest {result['fastest']:5.3f}x  CPU {result['cpu']:5.3f}x"
        )
    if args.json:
        write_results(
            args.json,
            "training_overhead",
            [
                {
                    "label": label,
                    "ratio": result["wall"],
                    "target": target,
                    "q1": result["quartiles"][0],
                    "q3": result["quartiles"][1],
                    "fastest": result["fastest"],
                    "cpu": result["cpu"],
                }
                for label, result, target in rows
            ],
        )

if __name__ == "__main__":
    main()
