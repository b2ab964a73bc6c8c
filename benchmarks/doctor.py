"""What does the NaN doctor cost?

Prints, for a model of about a million parameters (an elementwise sqrt(w x) layer in
front of a 512 -> 1024 -> 512 -> 1 MLP) on 32 batches of 64 with a NaN gradient in batch
k = 20 (one input feature of one row 0, where d sqrt(w x) / dw = 0 * inf):

1. the time ``companion.diagnostics.diagnose`` takes from the call to the diagnosis
   (tracing its compiled step, scanning batches 0..k, the op-by-op re-run of batch k),
   against one epoch of ``model.fit`` on the same data (compiled, steady state), and
   against the ``k + 1`` steps of ``fit`` that reach the NaN;
2. ``companion.training.train`` with the doctor armed (the default: it diagnoses the
   first skipped step) against the same loop with the doctor's hook removed, on data
   without a NaN, where no step is skipped; target <= 1.01;
3. ``model.fit`` with the :class:`~companion.diagnostics.NaNDoctor` callback against
   ``fit`` with ``keras.callbacks.TerminateOnNaN``, on data without a NaN (the callback
   runs ``fit``'s steps through ``train``'s guarded step and reads its records after every
   batch; informative, no target: ``benchmarks/scale.py`` measures it against the model's
   size), and the doctor's cost per step in ms.

As in ``benchmarks/training_overhead.py``, runs alternate in rounds and each ratio is the
median of the ratios of runs in the same round; the ratio of the fastest runs and of
process CPU time are printed next to it. Run with::

    python benchmarks/doctor.py [--quick] [--json PATH]

``--quick`` (2 rounds of each, a model of 64 features and hidden layers of 64 and 32) only
checks that the benchmark runs: its ratios are not the full run's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from _results import ratio, rounds, write_results

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from companion.diagnostics import NaNDoctor, diagnose, hooks  # noqa: E402
from companion.training import train  # noqa: E402

FEATURES, BATCH, BATCHES, BAD_BATCH = 512, 64, 32, 20
WIDTHS = (1024, 512)  # the MLP's hidden layers (--quick: a small model, 64 features)


class Root(keras.layers.Layer):
    """sqrt(w * x), one weight per feature."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones", name="w")

    def call(self, x):
        return tf.sqrt(self.w * x)


def make_model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            Root(name="root"),
            keras.layers.Dense(WIDTHS[0], activation="relu"),
            keras.layers.Dense(WIDTHS[1], activation="relu"),
            keras.layers.Dense(1),
        ],
        name="net",
    )


def make_data(poisoned: bool) -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.5, size=(BATCH * BATCHES, FEATURES)).astype("float32")
    y = rng.normal(size=(BATCH * BATCHES, 1)).astype("float32")
    if poisoned:
        x[BAD_BATCH * BATCH + 3, 0] = 0.0  # one feature of one row
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).cache()


def time_to_diagnosis(repeats: int) -> dict:
    poisoned = make_data(poisoned=True)
    clean = make_data(poisoned=False)
    fit_model = make_model()
    fit_model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse", jit_compile=True)
    fit_model.fit(clean, epochs=1, verbose=0)  # compile
    found = []

    def doctor():
        model = make_model()  # a fresh model: nothing traced yet, as for a user
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse", jit_compile=True)
        found.append(diagnose(model, poisoned))

    runs = {"diagnose": doctor, "fit epoch": lambda: fit_model.fit(clean, epochs=1, verbose=0)}
    wall, cpu = rounds(runs, repeats)
    d = found[-1]
    assert d is not None and (d.batch, d.op, d.layer) == (BAD_BATCH, "SqrtGrad", "net/root"), d
    print(f"\n1. time to the diagnosis, {repeats} rounds (the doctor's answer: {d.cause} in {d.op}, "
          f"layer {d.layer}, batch {d.batch})")
    for key in runs:
        print(f"  {key:<12} median {statistics.median(wall[key]):7.3f}s  fastest {min(wall[key]):7.3f}s")
    result = ratio(wall, cpu, "diagnose", "fit epoch")
    per_step = statistics.median(wall["fit epoch"]) / BATCHES
    result["vs_steps_to_nan"] = statistics.median(wall["diagnose"]) / (per_step * (BAD_BATCH + 1))
    return result


def armed_vs_not(repeats: int, warmups: int = 2) -> dict:
    clean = make_data(poisoned=False)
    armed_model, armed_opt = make_model(), keras.optimizers.Adam(1e-4)
    open_model, open_opt = make_model(), keras.optimizers.Adam(1e-4)
    hook = hooks.diagnose_skipped_step
    # The training loop calls the doctor's hook (companion.diagnostics.hooks) through the
    # name it imported: disarm it in every module of companion.training that holds it.
    owners = [hooks] + [
        module for name, module in sorted(sys.modules.items())
        if name.startswith("companion.training") and getattr(module, "diagnose_skipped_step", None) is hook
    ]
    if len(owners) == 1:
        raise RuntimeError("no module of companion.training holds diagnose_skipped_step: where is the doctor's hook?")

    def disarmed():
        for module in owners:
            module.diagnose_skipped_step = lambda run, step: None
        try:
            train(open_model, clean, loss="mse", optimizer=open_opt, epochs=1, verbose=0)
        finally:
            for module in owners:
                module.diagnose_skipped_step = hook

    runs = {
        "armed": lambda: train(armed_model, clean, loss="mse", optimizer=armed_opt, epochs=1, verbose=0),
        "disarmed": disarmed,
    }
    for run in runs.values():
        for _ in range(warmups):
            run()
    wall, cpu = rounds(runs, repeats)
    print(f"\n2. train on clean data, doctor armed / disarmed, {repeats} rounds")
    for key in runs:
        print(f"  {key:<12} median {statistics.median(wall[key]):7.3f}s  fastest {min(wall[key]):7.3f}s")
    return ratio(wall, cpu, "armed", "disarmed")


def callback_cost(repeats: int) -> tuple[dict, dict, float]:
    clean = make_data(poisoned=False)
    callbacks = {
        "NaNDoctor": NaNDoctor, "TerminateOnNaN": keras.callbacks.TerminateOnNaN,
    }
    models = {}
    for key in callbacks:
        models[key] = make_model()
        models[key].compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse", jit_compile=True)
    runs = {
        key: (lambda key=key: models[key].fit(clean, epochs=1, verbose=0, callbacks=[callbacks[key]()]))
        for key in callbacks
    }
    for run in runs.values():
        run()
    wall, cpu = rounds(runs, repeats)
    print(f"\n3. fit on clean data, NaNDoctor (fit's steps run through train's guarded step) / TerminateOnNaN, "
          f"{repeats} rounds")
    for key in runs:
        print(f"  {key:<20} median {statistics.median(wall[key]):7.3f}s  fastest {min(wall[key]):7.3f}s")
    per_step = (statistics.median(wall["NaNDoctor"]) - statistics.median(wall["TerminateOnNaN"])) / BATCHES
    print(f"  NaNDoctor's cost per step: {per_step * 1e3:.2f} ms (median epoch difference / {BATCHES} steps)")
    return ratio(wall, cpu, "NaNDoctor", "TerminateOnNaN"), per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of each: a smoke test (seconds)")
    parser.add_argument("--json", metavar="PATH", help="also write the ratios as JSON to PATH")
    args = parser.parse_args()
    repeats_diagnosis, repeats_train, repeats_fit = (2, 2, 2) if args.quick else (9, 40, 24)
    if args.quick:
        global FEATURES, WIDTHS
        FEATURES, WIDTHS = 64, (64, 32)
    params = make_model().count_params()
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, {os.cpu_count()} CPU cores; "
          f"model of {params:,} parameters, {BATCHES} batches of {BATCH}, NaN in batch {BAD_BATCH}")
    diagnosis = time_to_diagnosis(repeats_diagnosis)
    armed = armed_vs_not(repeats_train, warmups=1 if args.quick else 2)
    fit_cost, per_step = callback_cost(repeats_fit)
    print("\nRatios, lower is better ('wall' is the verdict; 'fastest' and 'CPU' as in training_overhead.py).")
    rows = [
        ("time to diagnosis / one epoch of fit", diagnosis, None),
        ("train, doctor armed / disarmed (clean steps)", armed, 1.01),
        ("fit, NaNDoctor / TerminateOnNaN (clean steps)", fit_cost, None),
    ]
    for label, result, target in rows:
        q1, q3 = result["quartiles"]
        verdict = "" if target is None else f" (target <= {target:.2f}x: {'ok' if result['wall'] <= target else 'MISSED'})"
        print(f"  {label:<54} wall {result['wall']:6.3f}x{verdict}  quartiles {q1:.2f}..{q3:.2f}"
              f"  fastest {result['fastest']:6.3f}x  CPU {result['cpu']:6.3f}x")
    print(f"  time to diagnosis / the {BAD_BATCH + 1} fit steps that reach the NaN: "
          f"{diagnosis['vs_steps_to_nan']:.2f}x")
    if args.json:
        write_results(
            args.json,
            "doctor",
            [
                {
                    "label": label, "ratio": result["wall"], "target": target if target is not None else float("inf"),
                    "q1": result["quartiles"][0], "q3": result["quartiles"][1],
                    "fastest": result["fastest"], "cpu": result["cpu"],
                }
                for label, result, target in rows
            ],
        )


if __name__ == "__main__":
    main()
