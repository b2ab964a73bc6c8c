"""``on_nonfinite="rollback"`` and ``skip_loss_spikes`` under MirroredStrategy over two logical CPUs,
and under MultiWorkerMirroredStrategy over two workers.

The same three runs as ``tests/unit/test_training_recovery.py`` (its data and models), in
a fresh process: the logical devices must be configured before TensorFlow runs an op.
Every replica rolls back and skips together, and ends with the same weights. The
multi-worker runs (``recovery_worker.py``, started by :func:`companion.launch.launch` as in
``test_training_multiworker.py``): a diverging run that rolls back, and a spiky epoch;
every worker rolls back and skips at the same steps and ends with the same weights.
"""

from __future__ import annotations

import json
import pathlib
import textwrap

import pytest

from companion.launch import launch
from fresh_process import TWO_CPUS, run_script  # tests/distributed/fresh_process.py

SCRIPT = TWO_CPUS + textwrap.dedent(
    r"""
    import keras
    import numpy as np
    sys.path.insert(0, os.path.join(os.environ["COMPANION_TESTS"], "unit"))
    from test_training_recovery import (
        BATCH, OUTLIERS, SPIKE_BATCH, SPIKE_BATCHES, mlp, regression, sgd, small_mlp, spiky_data,
    )
    from companion.training import NonFiniteError, train

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

    def replicas_agree(model):
        return all(
            all(np.array_equal(np.asarray(c.numpy()), np.asarray(v.value.values[0].numpy())) for c in v.value.values)
            for v in model.trainable_variables
        )

    def finite(model):
        return all(np.isfinite(np.asarray(v.numpy())).all() for v in model.variables)

    result = {"replicas": strategy.num_replicas_in_sync}
    x, y = regression()
    with strategy.scope():
        model, optimizer = mlp(), sgd(0.3)
    history = train(model, x, y, batch_size=BATCH, epochs=6, loss="mse", optimizer=optimizer, strategy=strategy,
                    on_nonfinite="rollback", shuffle=False, verbose=0)
    result["rollback"] = {
        "rates": [r.learning_rate for r in history.rollbacks],
        "steps": [(r.step, r.restored_step) for r in history.rollbacks],
        "rate": float(tf.convert_to_tensor(optimizer.learning_rate).numpy()),
        "finite": finite(model), "agree": replicas_agree(model), "epoch_loss": history.epoch_loss,
    }
    with strategy.scope():
        reference, reference_optimizer = mlp(), sgd(result["rollback"]["rate"])
    clean = train(reference, x, y, batch_size=BATCH, epochs=6, loss="mse", optimizer=reference_optimizer,
                  strategy=strategy, shuffle=False, verbose=0)
    result["rollback"]["reference_loss"] = clean.epoch_loss

    x_nan = x.copy()
    x_nan[5 * BATCH: 9 * BATCH: 7, 2] = np.nan
    with strategy.scope():
        model, optimizer = mlp(), sgd(0.01)
    try:
        train(model, x_nan, y, batch_size=BATCH, epochs=2, loss="mse", optimizer=optimizer, strategy=strategy,
              on_nonfinite="rollback", max_consecutive_nonfinite=3, shuffle=False, verbose=0)
        result["data"] = None
    except NonFiniteError as error:
        result["data"] = {
            "step": error.step, "rollbacks": len(error.history.rollbacks),
            "cause": None if error.diagnosis is None else error.diagnosis.cause, "message": str(error),
            "finite": finite(model),
        }

    xs, ys = spiky_data()
    validation = regression(1024, seed=2)
    losses = {}
    for name, data, options in [
        ("guarded", (xs, ys), dict(skip_loss_spikes=6)),
        ("without", None, {}),
    ]:
        if data is None:
            keep = np.ones(len(xs), bool)
            for batch in OUTLIERS:
                keep[batch * SPIKE_BATCH: (batch + 1) * SPIKE_BATCH] = False
            data = (xs[keep], ys[keep])
        with strategy.scope():
            model = small_mlp()
            optimizer = keras.optimizers.Adam(3e-3)
        spiky = train(model, *data, batch_size=SPIKE_BATCH, epochs=3, loss="mse", optimizer=optimizer,
                      validation_data=validation, strategy=strategy, shuffle=False, verbose=0, **options)
        losses[name] = spiky.history["val_loss"][-1]
        if name == "guarded":
            result["spikes"] = {"skipped": spiky.skipped, "spikes": spiky.spikes, "agree": replicas_agree(model),
                                "reasons": sorted({r.reason for r in spiky.reports})}
    result["spikes"]["val_loss"] = losses
    print("RESULT " + json.dumps(result))
    """
)


@pytest.fixture(scope="module")
def result() -> dict:
    return run_script(SCRIPT, timeout=900)


@pytest.mark.slow
def test_mirrored_diverging_run_rolls_back_on_every_replica(result):
    run = result["rollback"]
    assert result["replicas"] == 2
    assert run["rates"] and run["rate"] < 0.3 and run["finite"] and run["agree"]
    # One step per host call here: each rollback comes at its limit, mid-epoch, and the
    # run trains at the last rate from the restored state for what remains of its six
    # epochs; its loss is that of the run started at that rate after fewer epochs.
    assert run["epoch_loss"][-1] < 1.5 * run["reference_loss"][1]


@pytest.mark.slow
def test_mirrored_nan_in_the_data_stops_at_once_with_the_data_named(result):
    data = result["data"]
    assert data is not None and data["rollbacks"] == 0 and data["step"] == 7
    assert data["cause"] == "nonfinite_input" and "No rollback was made for it" in data["message"] and data["finite"]


@pytest.mark.slow
def test_mirrored_spikes_are_skipped_at_the_outlier_batches_on_every_replica(result):
    spikes = result["spikes"]
    expected = [epoch * 128 + batch for epoch in range(3) for batch in (40, 100)]  # the unit test's OUTLIERS
    assert spikes["skipped"] == spikes["spikes"] == expected
    assert spikes["reasons"] == ["spike"] and spikes["agree"]
    assert spikes["val_loss"]["guarded"] < 1.5 * spikes["val_loss"]["without"]


# --------------------------------------------------------------------------------------
# Several workers
# --------------------------------------------------------------------------------------

WORKER = pathlib.Path(__file__).with_name("recovery_worker.py")


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("recovery-workers")
    env = {"CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONHASHSEED": "0"}
    launched = launch(WORKER, 2, ["--out", str(out)], timeout=300, grace=60, env=env)
    failures = "\n".join(f"--- worker {w.index} (exit {w.returncode}):\n{w.output[-3000:]}" for w in launched.workers)
    assert launched.ok, failures
    return {index: json.loads((out / f"worker-{index}.json").read_text()) for index in range(2)}


@pytest.mark.slow
def test_every_worker_rolls_back_at_the_same_steps_and_ends_alike(workers):
    first, second = workers[0]["rollback"], workers[1]["rollback"]
    assert workers[0]["replicas"] == 2
    assert first == second  # rollbacks, rates, weights, history
    assert first["rollbacks"] and first["rate"] < 0.3 and first["finite"]
    assert first["rate"] == pytest.approx(0.3 * first["rollbacks"][-1]["scale"])
    assert all(r["restored_step"] < r["step"] for r in first["rollbacks"])


@pytest.mark.slow
def test_every_worker_skips_the_same_spikes_and_ends_alike(workers):
    first, second = workers[0]["spikes"], workers[1]["spikes"]
    assert first == second
    assert first["skipped"] == first["spikes"] == [40, 100]  # the unit test's OUTLIERS, one epoch
    assert first["reasons"] == ["spike"] and first["finite"]
