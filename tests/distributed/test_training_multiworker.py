"""companion.training.train under MultiWorkerMirroredStrategy (the launcher's own tests are in test_launch.py).

Every scenario starts real worker processes with :func:`companion.launch.launch`, in its
private, loopback-only network namespace (free ports, ``TF_CONFIG`` set by the
launcher); nothing can reach the workers from outside. Each worker runs
tests/distributed/multiworker_worker.py and writes what it saw to a JSON file. A TensorFlow import
takes seconds, so each launch runs several checks: a two-worker run (clean, poisoned, and
``on_nonfinite="raise"``), a three-worker clean run, and a two-worker run in which worker
1 kills itself mid-epoch (the default strategy, a Python input pipeline), followed by a
restart that resumes from the checkpoint. The kill matrix (``-m killmatrix``, run once by
.ci/run) kills a worker at every moment of training.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import numpy as np
import pytest

from companion.launch import launch

WORKER = pathlib.Path(__file__).with_name("multiworker_worker.py")
ENV = {"CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONHASHSEED": "0"}
#: The bound on a survivor's exit after its peer was killed (documented in train's
#: on_worker_loss: detection by the coordination service, then at most
#: WORKER_LOSS_EXIT_SECONDS until the process ends).
SURVIVOR_EXIT_BOUND = 60.0
#: Python work per batch in the killed runs' input pipeline (tf.py_function), as when a
#: pipeline decodes files with a Python library: what kept survivors alive before.
SLEEP_PER_BATCH = "0.05"


def run_workers(directory: pathlib.Path, scenario: str, workers: int, *args: str):
    out = directory / f"{scenario}-{workers}"
    out.mkdir()
    result = launch(
        WORKER, workers, ["--out", str(out), "--scenario", scenario, *args], timeout=150, grace=60, env=ENV
    )
    reports = {}
    for index in range(workers):
        path = out / f"{scenario}-worker-{index}.json"
        if path.exists():
            reports[index] = json.loads(path.read_text())
            reports[index]["output"] = result.workers[index].output  # stdout and stderr
    return result, reports


def failure(result) -> str:
    return "\n".join(f"--- worker {w.index} (exit {w.returncode}):\n{w.output[-3000:]}" for w in result.workers)


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory) -> dict:
    result, reports = run_workers(tmp_path_factory.mktemp("two"), "main", 2)
    assert result.ok, failure(result)
    return reports


@pytest.fixture(scope="module")
def three_workers(tmp_path_factory) -> dict:
    result, reports = run_workers(tmp_path_factory.mktemp("three"), "clean", 3)
    assert result.ok, failure(result)
    return reports


@pytest.fixture(scope="module")
def killed_then_resumed(tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("killed")
    checkpoints = directory / "checkpoints"
    # Each worker's input pipeline reads all 8 global batches per epoch (data sharding):
    # batch 20 is batch 4 of epoch 3, after the checkpoint of epoch 2.
    died, died_reports = run_workers(
        directory, "die", 2, "--checkpoint-dir", str(checkpoints), "--die-worker", "1", "--die-at-batch", "20",
        "--sleep-per-batch", SLEEP_PER_BATCH,  # and the default strategy: no communication options
    )
    files_after_death = sorted(os.listdir(checkpoints))
    resumed, resumed_reports = run_workers(directory, "resume", 2, "--checkpoint-dir", str(checkpoints))
    files_after_resume = sorted(os.listdir(checkpoints))  # once every worker has exited
    return {
        "files_after_resume": files_after_resume,
        "died": died,
        "died_reports": died_reports,
        "files_after_death": files_after_death,
        "resumed": resumed,
        "resumed_reports": resumed_reports,
    }


# --------------------------------------------------------------------------------------
# Training on several workers
# --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_worker_ends_with_identical_weights_and_history(two_workers):
    first, second = two_workers[0], two_workers[1]
    assert first["replicas"] == second["replicas"] == 2
    assert first["clean"] == second["clean"]  # weights, history (as JSON), iteration count
    assert first["clean"]["iterations"] == 4 * 8


@pytest.mark.slow
def test_two_workers_train_like_one_process_on_the_same_global_batches(two_workers):
    import keras
    import tensorflow as tf

    from companion.training import TrainingHistory, train

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype("float32")
    y = (x @ np.array([[1.0], [2.0], [-1.0]], "float32")).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    history = train(
        model, tf.data.Dataset.from_tensor_slices((x, y)).batch(8), loss="mse",
        optimizer=keras.optimizers.Adam(0.05), epochs=4, verbose=0, jit_compile=False,
    )
    workers = TrainingHistory.from_json(two_workers[0]["clean"]["history"])
    np.testing.assert_allclose(workers.step_loss, history.step_loss, rtol=1e-4, atol=1e-6)
    for got, expected in zip(two_workers[0]["clean"]["weights"], model.get_weights()):
        np.testing.assert_allclose(np.array(got), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_three_workers_with_unequal_parts_of_each_batch_train_as_fit_weighs_the_parts(three_workers):
    import keras
    import tensorflow as tf

    from companion.training import train

    reports = [three_workers[i] for i in range(3)]
    assert reports[0]["replicas"] == 3
    assert reports[0]["clean"] == reports[1]["clean"] == reports[2]["clean"]
    # A batch of 8 is split 3 + 3 + 2. train computes the loss as fit does under a
    # strategy: the mean of each replica's mean loss (Keras divides each replica's by
    # the replica count), not the mean over the 8 examples when the parts differ in size
    # (book/reference/differences_from_fit.md). One process reproduces it with sample
    # weights 8 / (3 * part size): (1/8) sum w_i l_i = (1/3) sum over parts of their mean.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype("float32")
    y = (x @ np.array([[1.0], [2.0], [-1.0]], "float32")).astype("float32")
    w = np.tile(np.array([8 / 9] * 6 + [4 / 3] * 2, "float32"), 8)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    train(
        model, tf.data.Dataset.from_tensor_slices((x, y, w)).batch(8), loss="mse",
        optimizer=keras.optimizers.Adam(0.05), epochs=4, verbose=0, jit_compile=False,
    )
    for got, expected in zip(reports[0]["clean"]["weights"], model.get_weights()):
        np.testing.assert_allclose(np.array(got), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_nan_on_one_worker_skips_the_step_on_every_worker(two_workers):
    from companion.training import TrainingHistory

    first, second = two_workers[0], two_workers[1]
    assert first["nan_in_my_part"] == [False, False] and second["nan_in_my_part"] == [False, True]
    assert first["poisoned"] == second["poisoned"]
    # Keras' step under MWMS (its collectives inside) does not compile with XLA on CPU:
    # train fell back to running it without XLA, as its docstring says.
    assert first["poisoned"]["xla"] is False
    history = TrainingHistory.from_json(first["poisoned"]["history"])
    assert history.skipped == [1, 9]
    assert first["poisoned"]["iterations"] == 2 * 8 - 2
    assert all(np.isfinite(np.array(w)).all() for w in first["poisoned"]["weights"])
    assert "dense" in history.reports[0].gradients[0].path


@pytest.mark.slow
def test_a_gan_s_step_with_a_nan_on_one_worker_is_skipped_on_every_worker_and_changes_nothing(two_workers):
    first, second = two_workers[0]["gan"], two_workers[1]["gan"]
    assert first == second  # every worker: the same skips, bit for bit the same state
    assert first["twin"]["skipped"] == [] and first["poisoned"]["skipped"] == [1]
    assert first["poisoned"]["steps"] == 2
    # The doctor does not re-run a model's own step on several workers (its collectives
    # would be joined by one worker only): the step is skipped, undiagnosed.
    assert first["poisoned"]["diagnosed"] == [False]
    # The weights, both optimizers' state and the trackers: as if batch 1 never came.
    assert first["poisoned"]["state"] == first["twin"]["state"]
    assert all(np.isfinite(np.array(v)).all() for v in first["poisoned"]["state"].values())


@pytest.mark.slow
def test_the_nan_doctor_names_the_worker_whose_shard_made_the_nan_on_every_worker(two_workers):
    from companion.training import TrainingHistory

    first, second = two_workers[0], two_workers[1]
    # The doctor runs on every worker and changes nothing: the same weights, history and
    # diagnosis (bit for bit, as JSON) on both.
    assert first["doctor"] == second["doctor"]
    assert first["poisoned"] == second["poisoned"]
    history = TrainingHistory.from_json(first["doctor"]["history"])
    assert history.skipped == [1] and first["doctor"]["iterations"] == 8 - 1
    d = history.reports[0].diagnosis
    assert (d.worker, d.batch, d.op, d.forward_op, d.layer, d.cause) == (
        1, 1, "SqrtGrad", "Sqrt", "net/root", "singular_derivative"
    )
    assert d.inputs_summary == "worker 1's shard made the NaN; 1 of 4 inputs of Sqrt are exactly 0"
    assert d.source.rsplit(":", 1)[0].endswith("multiworker_worker.py")
    assert "tf.sqrt(self.w * x)" in d.code
    poisoned = TrainingHistory.from_json(first["poisoned"]["history"]).reports[0].diagnosis
    assert (poisoned.worker, poisoned.batch, poisoned.cause) == (1, 1, "nonfinite_input")
    assert poisoned.inputs_summary.startswith("worker 1's shard made the NaN; 1 of 12 entries of x")
    assert TrainingHistory.from_json(first["poisoned"]["history"]).reports[1].diagnosis is None


@pytest.mark.slow
def test_the_cluster_gathers_every_length_exactly_with_one_compiled_function(two_workers):
    for report in two_workers.values():
        rows = report["gather"]["rows"]
        for n, got in zip((1, 3, 1024), rows):
            np.testing.assert_array_equal(np.array(got), [np.arange(n), 1000.0 + np.arange(n)])
        # Traced once in this process: for the four runs of the scenario, the doctor's
        # rows and payloads, and the 1, 3 and 1024 values above.
        assert report["gather"]["traces"] == 1


@pytest.mark.slow
def test_no_worker_warns_that_a_tf_function_retraces(two_workers, three_workers):
    for report in [*two_workers.values(), *three_workers.values()]:
        assert "retracing" not in report["output"], report["output"][-3000:]


@pytest.mark.slow
def test_nonfinite_error_is_raised_on_every_worker(two_workers):
    first, second = two_workers[0]["raised"], two_workers[1]["raised"]
    assert first is not None and first == second
    assert (first["step"], first["epoch"], first["iterations"]) == (1, 0, 1)
    assert "on_nonfinite='raise'" in first["message"]


# --------------------------------------------------------------------------------------
# Losing a worker, and resuming
# --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_killed_worker_makes_the_survivor_exit_with_a_clear_error_in_bounded_time(killed_then_resumed):
    result = killed_then_resumed["died"]
    survivor, killed = result.workers
    assert killed.returncode == -9, failure(result)  # SIGKILL: no clean-up at all
    assert survivor.returncode == 1 and not survivor.stopped, failure(result)  # exited by itself
    assert survivor.seconds - killed.seconds < SURVIVOR_EXIT_BOUND, failure(result)
    assert "WorkerLostError: worker 0 of 2 lost a peer during epoch 3" in survivor.output
    lost = killed_then_resumed["died_reports"][0]["lost"]
    assert lost["epoch"] == 2 and lost["checkpoint"].endswith("ckpt-2")
    assert lost["cause"] in ("UnavailableError", "DeadlineExceededError", "CancelledError", "AbortedError")
    assert "restart all workers with the same checkpoint_dir to resume from" in lost["message"]
    # The checkpoints of epochs 1 and 2 are intact, and no worker's scratch directory is left.
    files = killed_then_resumed["files_after_death"]
    assert "ckpt-2.index" in files and "checkpoint" in files
    assert not [f for f in files if f.startswith(".worker")]


@pytest.mark.slow
def test_restarted_workers_resume_after_the_last_completed_epoch(killed_then_resumed, two_workers):
    result = killed_then_resumed["resumed"]
    assert result.ok, failure(result)
    first, second = killed_then_resumed["resumed_reports"][0], killed_then_resumed["resumed_reports"][1]
    # Epochs 3 and 4 only: 32 optimizer steps in all, and this run's input pipeline read
    # 2 x 8 batches (plus what it prefetched of the next pass), not 4 x 8.
    assert first["iterations"] == second["iterations"] == 4 * 8
    assert 2 * 8 <= first["batches_read"] < 3 * 8 and 2 * 8 <= second["batches_read"] < 3 * 8
    assert first["weights"] == second["weights"] and first["history"] == second["history"]
    # Bit for bit the uninterrupted run of the same data.
    assert first["weights"] == two_workers[0]["clean"]["weights"]
    assert first["history"] == two_workers[0]["clean"]["history"]
    # (The chief's own listing may still see worker 1's scratch directory being deleted.)
    files = killed_then_resumed["files_after_resume"]
    assert "ckpt-4.index" in first["files"] and "ckpt-4.index" in files
    assert not [f for f in files if f.startswith(".worker")]


#: Moments of the kill matrix, as the batch of the killed worker's input pipeline at
#: which it dies (8 batches per epoch, 4 epochs; the chief checkpoints after each epoch).
KILL_MOMENTS = {
    "first-step-compilation": "1",
    "mid-epoch": "12",
    "between-epochs-while-the-chief-checkpoints": "17",
    "last-step": "32",
}


KILLS = [(moment, "1", "SIGKILL") for moment in KILL_MOMENTS] + [
    ("mid-epoch", "0", "SIGKILL"),
    ("between-epochs-while-the-chief-checkpoints", "0", "SIGKILL"),
    ("mid-epoch", "1", "SIGSTOP"),  # alive but not responding: found by the coordination service's heartbeats
]


@pytest.mark.killmatrix
@pytest.mark.parametrize(
    "moment, killed, signal_name", KILLS, ids=[f"{m}-worker-{k}-{s}" for m, k, s in KILLS]
)
def test_kill_matrix_every_survivor_exits_in_bounded_time_and_checkpoints_stay_complete(
    moment, killed, signal_name, tmp_path
):
    checkpoints = tmp_path / "checkpoints"
    result, reports = run_workers(
        tmp_path, "die", 2, "--checkpoint-dir", str(checkpoints), "--die-worker", killed,
        "--die-at-batch", KILL_MOMENTS[moment], "--sleep-per-batch", SLEEP_PER_BATCH, "--die-by", signal_name,
    )
    dead = result.workers[int(killed)]
    survivor = result.workers[1 - int(killed)]
    assert survivor.returncode != 0 and not survivor.stopped, failure(result)
    if signal_name == "SIGKILL":
        assert dead.returncode == -9, failure(result)
        assert survivor.seconds - dead.seconds < SURVIVOR_EXIT_BOUND, failure(result)
    else:
        # The stopped worker never exits by itself (the launcher ends it); the survivor
        # raised WorkerLostError within the bound of the moment its peer stopped.
        assert dead.stopped, failure(result)
        stopped_at = float((tmp_path / "die-2" / f"died-at-{killed}").read_text())
        lost_at = reports[1 - int(killed)]["lost"]["time"]
        assert lost_at - stopped_at < SURVIVOR_EXIT_BOUND, failure(result)
    files = sorted(os.listdir(checkpoints)) if checkpoints.exists() else []
    # Only complete checkpoints: every index file has its data file, and "checkpoint" names one of them.
    indexes = [f[: -len(".index")] for f in files if f.endswith(".index")]
    assert all(any(f.startswith(prefix + ".data-") for f in files) for prefix in indexes), files
    if "checkpoint" in files:
        latest = (checkpoints / "checkpoint").read_text().split('"')[1]
        assert latest in indexes, (latest, files)

