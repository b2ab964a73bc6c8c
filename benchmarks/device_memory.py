"""What would ``train``, the NaN doctor and ``SkipNonFinite`` hold in an accelerator's memory?

``benchmarks/scale.py`` measures memory as the growth of the process's peak resident set,
which on a CPU counts everything the process holds: the tensors, and the host's own costs
(the traced graphs and their optimisation, Python's objects, the C library's per-thread
memory pools, and what the doctor keeps on the host: a small state's copy). On a GPU only
the tensors are in the accelerator's memory, which is where a model stops fitting. This
script measures them apart: the peak of TensorFlow's own allocator over the whole call
(``TF_CPU_ALLOCATOR_USE_BFC=true``, so that the CPU allocator keeps count of its peak, as
in ``benchmarks/update_peak.py``), for scale.py's models and variants (its batches, 2
epochs), each run a fresh process and a fresh model. On this CPU the allocator also holds
what a GPU run keeps in host memory: the input pipeline's batches (the doctor's kept
batches among them); the figures are for the tensors, not for a particular GPU.

How the allocator gets its memory changes what its peak counts. TensorFlow's allocator
(BFC) cuts each tensor from a larger free piece and splits that piece only if the piece
is at least twice the tensor's size; otherwise the whole piece is the tensor's, and its
unused rest counts as held. Each run is made both ways:

* ``reserved``: one region of :data:`RESERVE_BYTES` is reserved before anything else is
  allocated (its pages are never touched, so it costs no resident memory), as TensorFlow
  does on a GPU by default (it maps nearly all of the GPU's memory at its first
  allocation). Every tensor is cut from that region: the peak counts the tensors' own
  bytes and the gaps between them.
* ``growth``: the allocator grows region by region, each about twice the last, as on a
  GPU with ``tf.config.experimental.set_memory_growth``. A tensor then often gets a whole
  piece of a fresh region, and the peak also counts those pieces' unused rests, which
  depend on the order in which tensors were allocated. The reference ``fit-built`` shows
  how much: ``fit`` with its optimizer built before the call (as ``train`` builds it),
  otherwise the same run as ``fit``; its growth minus ``fit``'s is printed and kept in
  the JSON (no target: nothing but the order changed).

A variant's extra is its peak growth minus ``fit``'s in the same round, as a multiple of
the weights' bytes; each ratio is the median over rounds (the variants alternate in a
round, the order rotating from round to round), with its quartiles. Targets: scale.py's
memory targets (issue 41) read for the accelerator's memory: ``train`` and
``SkipNonFinite`` <= 0.25 x the weights' bytes, ``NaNDoctor`` <= 1 x. Run with::

    python benchmarks/device_memory.py [--quick] [--rounds N] [--models NAME,...] [--json PATH]

``--json auto`` writes into ``companion/book/benchmark_results/`` under the default name.
``--quick`` (the small CNN, 1 round, 8 batches an epoch, every variant in one process,
``reserved`` only, the allocator's peak reset between runs) only checks that the script
runs: its numbers are not the full run's. The full run (5 models, both allocations, 3
rounds, 150 processes) takes about half an hour on 2 cores (``--allocations`` picks one).
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
from scale import BATCH, MEMORY_TARGETS, MODELS, NAMES, VARIANTS, build, call, make_data  # noqa: E402

EPOCHS = 2
QUICK_BATCHES = {"cnn-bn": 8}
#: The allocator keeps count of its peak only as the BFC allocator (the CPU's default does not).
ENV = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}
#: How the allocator gets its memory (see the docstring); --quick runs the first only.
ALLOCATIONS = ("reserved", "growth")
#: The region reserved up front in ``reserved`` runs: far above the largest run's peak
#: (the 28 M MLP's is under 1 GiB); never touched, so it is address space, not memory.
RESERVE_BYTES = 4 * 2**30
#: The measured variants: scale.py's, and the reference of the allocation order.
MEASURED = (*VARIANTS, "fit-built")
LABELS = {**NAMES, "fit-built": "fit, optimizer built first"}


# --- the child: fresh models, one call each, one JSON line ----------------------------------


def reserve(allocation: str) -> None:
    """In a ``reserved`` run, make the allocator's first region :data:`RESERVE_BYTES` (an
    uninitialised tensor of that size, freed at once: the region stays, untouched)."""
    import tensorflow as tf

    if allocation == "reserved":
        tf.raw_ops.Empty(shape=[RESERVE_BYTES // 4], dtype=tf.float32, init=False)


def child(name: str, variant: str, batches: int, allocation: str = "growth") -> dict:
    """Train a fresh ``name`` model for :data:`EPOCHS` epochs with ``variant``: the growth of
    the allocator's peak over the call (from what it held before), in MiB."""
    import keras
    import numpy as np
    import tensorflow as tf

    model, kind = build(name)
    x, y = make_data(name, batches * BATCH)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True) if kind == "classes" else "mse"
    weights_bytes = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.trainable_weights)
    tf.config.experimental.reset_memory_stats("CPU:0")
    held = tf.config.experimental.get_memory_info("CPU:0")["current"]
    if variant == "fit-built":
        model.compile(optimizer=keras.optimizers.Adam(), loss=loss)
        model.optimizer.build(model.trainable_variables)
        history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0,
                            callbacks=[keras.callbacks.TerminateOnNaN()])
    else:
        history = call(variant, model, x, y, loss, EPOCHS)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    if allocation == "reserved" and peak > RESERVE_BYTES:
        raise RuntimeError(f"{name}, {variant}: the allocator's peak ({peak / 2**20:.0f} MiB) outgrew the reserved "
                           "region: raise RESERVE_BYTES")
    losses = history.history.get("loss", [])
    return {
        "model": name, "variant": variant, "batches": batches, "allocation": allocation,
        "growth_mib": (peak - held) / 2**20,
        "weights_bytes": weights_bytes, "params": int(model.count_params()),
        "completed": len(losses) == EPOCHS and all(np.isfinite(losses)),
    }


# --- the parent: rounds of fresh processes --------------------------------------------------


def run(name: str, variants: tuple[str, ...], batches: int, allocation: str) -> list[dict]:
    found = run_child_process(__file__, name, ",".join(variants), str(batches), allocation, env=ENV,
                              what=f"{name}, {allocation}, {', '.join(variants)}")
    runs = found["variants"] if "variants" in found else [found]
    for result in runs:
        if not result["completed"]:
            raise RuntimeError(f"the run of {name}, {result['variant']} did not end all its epochs with a finite "
                               "loss: it is not the clean run measured here")
    return runs


def measure(name: str, batches: int, rounds: int, allocation: str, one_process: bool = False) -> dict:
    """{variant: [per-round allocator peak growth in MiB]} and the model's size.

    ``one_process`` (--quick): every variant in one process."""
    variants = VARIANTS if one_process else MEASURED
    growth = {variant: [] for variant in variants}
    size = None
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        if one_process:
            print(f"  {name}, {allocation}: {', '.join(LABELS[v] for v in order)} in one process",
                  file=sys.stderr, flush=True)
            found = run(name, order, batches, allocation)
        else:
            found = []
            for variant in order:
                print(f"  {name}, {allocation}, round {r + 1}/{rounds}: {LABELS[variant]}, {EPOCHS} epochs of "
                      f"{batches} batches", file=sys.stderr, flush=True)
                found += run(name, (variant,), batches, allocation)
        for result in found:
            growth[result["variant"]].append(result["growth_mib"])
            size = size or {"params": result["params"], "weights_bytes": result["weights_bytes"]}
    return {"growth_mib": growth, **size, "batches": batches}


def extras_mib(measured: dict, variant: str) -> list[float]:
    """``variant``'s growth minus ``fit``'s, round by round, in MiB."""
    growth = measured["growth_mib"]
    return [v - f for v, f in zip(growth[variant], growth["fit"])]


def summarise(name: str, measured: dict, allocation: str) -> list[dict]:
    """Each variant's extra allocator peak over fit's, per byte of the weights."""
    growth, weights_mib = measured["growth_mib"], measured["weights_bytes"] / 2**20
    rows = []
    for variant in VARIANTS[1:]:
        extras = extras_mib(measured, variant)
        q1, extra, q3 = quartiles(extras)
        rows.append(dict(
            label=f"device memory, {allocation}, {name}: {NAMES[variant]} extra allocator peak / weights' bytes",
            ratio=round(extra / weights_mib, 4), q1=round(q1 / weights_mib, 4), q3=round(q3 / weights_mib, 4),
            target=MEMORY_TARGETS[variant], rounds=len(extras), extra_mib=round(extra, 2),
            fit_growth_mib=round(statistics.median(growth["fit"]), 2), model=name, variant=variant,
            allocation=allocation, kind="memory", params=measured["params"], weights_mib=round(weights_mib, 3),
        ))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{', '.join(QUICK_BATCHES)}, 1 round, every variant in one process (a smoke test)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--allocations", help=f"comma-separated, of {', '.join(ALLOCATIONS)} (default: both; "
                                              f"--quick: {ALLOCATIONS[0]})")
    parser.add_argument("--json", metavar="PATH", help="also write the ratios as JSON ('auto': the default name)")
    parser.add_argument("--child", nargs=4, metavar=("MODEL", "VARIANTS", "BATCHES", "ALLOCATION"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        name, variants, batches, allocation = args.child
        reserve(allocation)
        found = [child(name, variant, int(batches), allocation) for variant in variants.split(",")]
        print(json.dumps(found[0] if len(found) == 1 else {"variants": found}), flush=True)
        return 0

    names = args.models.split(",") if args.models else list(QUICK_BATCHES if args.quick else MODELS)
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; there are {list(MODELS)}")
    allocations = (args.allocations.split(",") if args.allocations
                   else ALLOCATIONS[:1] if args.quick else ALLOCATIONS)
    unknown = [a for a in allocations if a not in ALLOCATIONS]
    if unknown:
        parser.error(f"unknown allocations {unknown}; there are {list(ALLOCATIONS)}")
    rounds = 1 if args.quick else args.rounds
    where = ("--quick: every run in one process, each on a fresh model (a smoke run: not the full run's numbers)"
             if args.quick else "every run a fresh process and a fresh model")
    print(f"{rounds} round{'s' * (rounds > 1)}, {where}; batch {BATCH}, {EPOCHS} epochs; memory = the growth of "
          f"TensorFlow's allocator's peak over the call; allocations: {', '.join(allocations)}", flush=True)
    results, rows = {}, []
    started = time.perf_counter()
    for name in names:
        batches = QUICK_BATCHES.get(name, 2) if args.quick else MODELS[name][1]
        results[name] = {}
        for allocation in allocations:
            measured = results[name][allocation] = measure(name, batches, rounds, allocation, one_process=args.quick)
            model_rows = summarise(name, measured, allocation)
            rows += model_rows
            print(f"\n{name}, {allocation}: {MODELS[name][0]}, {measured['params'] / 1e6:.2f} M weights "
                  f"({measured['weights_bytes'] / 2**20:.1f} MiB); fit's allocator peak grew "
                  f"{model_rows[0]['fit_growth_mib']:.1f} MiB", flush=True)
            for row in model_rows:
                print(ratio_line(row, 88, f", {row['extra_mib']:+.1f} MiB"), flush=True)
            if "fit-built" in measured["growth_mib"]:
                q1, extra, q3 = quartiles(extras_mib(measured, "fit-built"))
                print(f"  reference: {LABELS['fit-built']}, over fit: {extra:+.1f} MiB (quartiles {q1:+.1f} to "
                      f"{q3:+.1f}), {extra / (measured['weights_bytes'] / 2**20):.2f} x the weights' bytes", flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s")
    print(VERDICT_LEGEND)
    if args.json:
        from _results import write_results

        models = {}
        for name, by_allocation in results.items():
            size = next(iter(by_allocation.values()))  # the model's size: the same in every allocation
            models[name] = {"description": MODELS[name][0], "params": size["params"],
                            "weights_bytes": size["weights_bytes"], "batches": size["batches"], "batch_size": BATCH,
                            "growth_mib": {allocation: m["growth_mib"] for allocation, m in by_allocation.items()}}
        write_results(args.json, "device_memory", rows, extra={
            "models": models, "epochs": EPOCHS, "allocations": list(allocations), "reserve_bytes": RESERVE_BYTES})
    return 0


if __name__ == "__main__":
    sys.exit(main())
