"""What does a first call of ``train`` cost, as a user meets it?

A fresh model, the whole call (compile, tracing, every epoch), against ``model.fit`` on
the same fresh model with its defaults (``jit_compile="auto"``: no XLA on CPU) and with
``jit_compile=True``, at 1, 3 and 10 epochs, for a small MLP (8 -> 64 -> 1, 128 batches
of 256 an epoch: per-step overhead dominates) and a compute-bound one (256 -> 512 -> 512
-> 1, 16 batches of 256). ``train(on_nonfinite="ignore")`` (the same call without the
guard) gives the guard's share of the fixed cost.

The runs alternate within a round (all variants of one configuration, in a rotating
order), and each ratio is the median over rounds of the ratio of runs made in the same
round, with its quartiles, for wall-clock time and for process CPU time. Targets (on
CPU): ``train`` / ``fit`` defaults <= 1.0 at every length for both models; the guard's
share of ``train``'s 1-epoch call <= 10 %, i.e. ``train`` / ``train(on_nonfinite="ignore")``
<= 1.1 on a fresh model. Run with::

    python benchmarks/cold_start.py [--quick] [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import VERDICT_LEGEND, quartiles, verdict  # noqa: E402

from companion.training import train  # noqa: E402

MODELS = {
    # name: (features, width, depth, batches per epoch)
    "small": (8, 64, 1, 128),
    "compute-bound": (256, 512, 2, 16),
}
BATCH = 256
VARIANTS = ("train", "train_unguarded", "fit", "fit_xla")
TARGET = 1.0
GUARD_SHARE_TARGET = 0.10


def data(features: int, batches: int):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * BATCH, features)).astype("float32")
    w = rng.normal(size=(features, 1)).astype("float32") / np.sqrt(features)
    return x, np.tanh(x @ w)


def fresh_model(features: int, width: int, depth: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    layers = [keras.Input((features,))]
    layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    layers.append(keras.layers.Dense(1))
    return keras.Sequential(layers)


def run(variant: str, spec, x, y, epochs: int) -> tuple[float, float]:
    """Wall-clock and process CPU seconds of one whole call on a fresh model."""
    model = fresh_model(*spec[:3])
    wall, cpu = time.perf_counter(), time.process_time()
    if variant.startswith("train"):
        on_nonfinite = "ignore" if variant == "train_unguarded" else "skip"
        train(model, x, y, batch_size=BATCH, epochs=epochs, loss="mse", optimizer=keras.optimizers.Adam(1e-3),
              on_nonfinite=on_nonfinite, verbose=0)
    else:
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse",
                      jit_compile=True if variant == "fit_xla" else "auto")
        model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)
    return time.perf_counter() - wall, time.process_time() - cpu


class Split:
    """Where the time of one whole call goes: ``train``'s (or ``compile``'s) set-up
    before ``fit``, the trace of Keras' own ``train_step``, the trace of the guard around
    it, and the rest of ``fit`` (building and optimising the function, running the
    steps, the callbacks)."""

    def __init__(self):
        self.times = {}

    def __enter__(self):
        import keras.src.backend.tensorflow.trainer as keras_trainer

        from companion.training import step as guarded

        self._undo = []
        timer = self

        def wrap(owner, name, key):
            original = getattr(owner, name)

            def timed(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    timer.times[key] = timer.times.get(key, 0.0) + time.perf_counter() - start

            setattr(owner, name, timed)
            self._undo.append((owner, name, original))

        wrap(keras_trainer.TensorFlowTrainer, "train_step", "keras_step")
        wrap(guarded.GuardedStep, "train_step", "guarded_step")
        wrap(keras.Model, "fit", "fit")
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)


def split_of(variant, spec, x, y, epochs, rounds):
    """Median seconds of each part of a whole call (see :class:`Split`)."""
    parts = {"set-up": [], "trace, Keras' step": [], "trace, the guard": [], "the rest of fit": [], "whole": []}
    for _ in range(rounds):
        with Split() as split:
            whole, _ = run(variant, spec, x, y, epochs)
        times = split.times
        keras_step = times.get("keras_step", 0.0)
        guard = max(times.get("guarded_step", 0.0) - keras_step, 0.0) if "guarded_step" in times else 0.0
        fit = times.get("fit", whole)
        parts["set-up"].append(whole - fit)
        parts["trace, Keras' step"].append(keras_step)
        parts["trace, the guard"].append(guard)
        parts["the rest of fit"].append(fit - keras_step - guard)
        parts["whole"].append(whole)
    return {k: statistics.median(v) for k, v in parts.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, 1 epoch, the small model (seconds)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", metavar="PATH",
                        help="also write the ratios (and the split, and each variant's median seconds) as JSON")
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    lengths = (1,) if args.quick else (1, 3, 10)
    models = {"small": MODELS["small"]} if args.quick else MODELS
    # One warm-up call of each variant, so that the first configuration does not pay
    # TensorFlow's own first-use costs (kernel registration, thread pools).
    spec = MODELS["small"]
    x, y = data(spec[0], 2)
    for variant in VARIANTS:
        run(variant, spec, x, y, 1)

    rows, splits, seconds = [], {}, {}
    print(f"{'model':<14}{'epochs':>6}  {'train':>7}{'unguarded':>10}{'fit':>7}{'fit XLA':>8}  (median seconds)")
    for name, spec in models.items():
        x, y = data(spec[0], spec[3])
        for epochs in lengths:
            walls = {v: [] for v in VARIANTS}
            cpus = {v: [] for v in VARIANTS}
            for r in range(rounds):
                order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
                for variant in order:
                    wall, cpu = run(variant, spec, x, y, epochs)
                    walls[variant].append(wall)
                    cpus[variant].append(cpu)
            medians = {v: statistics.median(walls[v]) for v in VARIANTS}
            seconds.setdefault(name, {})[str(epochs)] = {v: round(medians[v], 4) for v in VARIANTS}
            print(f"{name:<14}{epochs:>6}  {medians['train']:>7.2f}{medians['train_unguarded']:>10.2f}"
                  f"{medians['fit']:>7.2f}{medians['fit_xla']:>8.2f}", flush=True)
            measured = [("train / fit", "fit", TARGET)]
            if epochs == 1:  # the guard's share: the call against train(on_nonfinite="ignore")
                measured.append(("guarded / unguarded", "train_unguarded", 1 + GUARD_SHARE_TARGET))
            for label, against, target in measured:
                ratios = [t / f for t, f in zip(walls["train"], walls[against])]
                cpu_ratios = [t / f for t, f in zip(cpus["train"], cpus[against])]
                q1, median, q3 = quartiles(ratios)
                cpu_median = statistics.median(cpu_ratios)
                full = f"cold start, {name}, {epochs} epoch{'s' if epochs > 1 else ''}: {label}"
                print(f"  {full:<52} ratio {median:.2f} (quartiles {q1:.2f}-{q3:.2f}), CPU {cpu_median:.2f}, "
                      f"target {target}: {verdict(q1, q3, target)}", flush=True)
                rows.append(dict(label=full, ratio=round(median, 4), q1=round(q1, 4), q3=round(q3, 4),
                                 target=target, cpu_ratio=round(cpu_median, 4), rounds=rounds))
            if epochs == 1:
                splits[name] = {v: split_of(v, spec, x, y, 1, rounds) for v in ("train", "fit")}
                for variant, parts in splits[name].items():
                    shown = ", ".join(f"{k} {v:.2f} s" for k, v in parts.items())
                    print(f"  where a first call of {variant} goes ({name}, 1 epoch): {shown}", flush=True)
    print(VERDICT_LEGEND)
    if args.json:
        from _results import write_results

        # "seconds": the median wall seconds of each variant's whole call, per model and
        # length (fit with jit_compile=True among them: what XLA's compile costs a first call).
        write_results(args.json, "cold_start", rows, extra={"split": splits, "seconds": seconds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
