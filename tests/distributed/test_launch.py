"""companion.launch: TF_CONFIG, network isolation, and supervision of the workers.

The workers here are small pure-Python scripts (milliseconds to start), except one test
with TensorFlow's own gRPC server. Nothing is ever sent to an address but loopback: the
tests read listening sockets from ``/proc/<pid>/net/tcp*`` and, to show that a worker
cannot be reached from outside its job, try to connect to it on ``127.0.0.1`` of this
machine's own network namespace. Every launch has a timeout, and every wait a bound.
"""

from __future__ import annotations

import doctest
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

import companion.launch as launch_module
import companion.launch.network as launch_network
import companion.launch.supervisor as launch_supervisor
from companion.launch import (
    NetworkIsolationError,
    cluster_spec,
    free_ports,
    launch,
    main,
    network_isolation,
    tf_config,
)

LINUX = sys.platform.startswith("linux")
ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    config = json.loads(os.environ["TF_CONFIG"])
    index = config["task"]["index"]
    print("cluster", ",".join(config["cluster"]["worker"]), "index", index, "args", " ".join(sys.argv[1:]))
    mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
    if mode == "fail" and index == 1:
        sys.exit(3)
    if mode == "killed" and index == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if index == 1:
            sys.exit(4)
    if mode in ("fail", "killed", "sleep", "stubborn"):
        time.sleep(60)
    """
)


@pytest.fixture()
def script(tmp_path) -> pathlib.Path:
    path = tmp_path / "worker.py"
    path.write_text(SCRIPT)
    return path


def outputs(result) -> str:
    return "\n".join(f"--- worker {w.index} ({w.reason}):\n{w.output[-2000:]}" for w in result.workers)


# --------------------------------------------------------------------------------------
# TF_CONFIG and the basic launch (moved from tests/distributed/test_training_multiworker.py)
# --------------------------------------------------------------------------------------


def test_launch_gives_every_worker_its_tf_config(script):
    result = launch(script, 3, ["ok", "x y"], timeout=30)
    assert result.ok and result.returncodes == [0, 0, 0] and result.returncode == 0, outputs(result)
    assert result.failure is None and result.restarts == 0
    addresses = result.cluster["worker"]
    assert len(set(addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in addresses)
    for worker in result.workers:
        assert worker.output == f"cluster {','.join(addresses)} index {worker.index} args ok x y\n"


def test_a_failing_worker_fails_the_launch_and_the_others_are_stopped_after_the_grace_period(script):
    result = launch(script, 2, ["fail"], timeout=30, grace=0.5)
    assert result.returncodes[1] == 3 and not result.workers[1].stopped
    assert result.workers[0].stopped and result.workers[0].returncode == -signal.SIGTERM
    assert result.returncode == 3 and result.first_failure.index == 1
    # Stopped 0.5 s (the grace period) after worker 1 failed, not 60 s later.
    assert 0.5 <= result.workers[0].seconds - result.workers[1].seconds < 5
    assert result.seconds < 10


def test_the_timeout_stops_every_worker(script):
    result = launch(script, 2, ["sleep"], timeout=1, max_restarts=3)
    assert result.timed_out and not result.ok and result.returncode == 124
    assert all(w.stopped for w in result.workers) and result.seconds < 10
    assert result.restarts == 0  # a timeout is not a failure to restart after
    assert result.failure == "the timeout expired and the launcher stopped every worker still running"


def test_command_line_prefixes_output_and_returns_the_exit_code(script, capsys):
    assert main(["--workers", "2", str(script), "ok"]) == 0
    out = capsys.readouterr().out
    assert "[worker 0] cluster" in out and "[worker 1] cluster" in out
    assert main(["--workers", "2", "--grace", "0.5", str(script), "fail"]) == 3
    assert "[launch] worker 1 failed first: exit code 3" in capsys.readouterr().err


def test_launch_rejects_bad_input(script, tmp_path):
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        launch(script, 0)
    with pytest.raises(TypeError, match="workers must be an int"):
        launch(script, 2.0)
    with pytest.raises(FileNotFoundError, match="script not found"):
        launch(tmp_path / "missing.py", 2)
    with pytest.raises(TypeError, match="args must be a sequence of strings"):
        launch(script, 2, "--epochs 3")
    with pytest.raises(ValueError, match="timeout must be a number >= 0"):
        launch(script, 2, timeout=-1)
    with pytest.raises(ValueError, match="ports must hold 2 distinct ports"):
        launch(script, 2, ports=[5000, 5000])
    with pytest.raises(ValueError, match="max_restarts must be >= 0, got -1"):
        launch(script, 2, max_restarts=-1)
    with pytest.raises(TypeError, match="max_restarts must be an int"):
        launch(script, 2, max_restarts=1.5)
    with pytest.raises(ValueError, match="pass allow_network_exposure=True as well"):
        launch(script, 2, isolate=False)
    with pytest.raises(ValueError, match="host must be a loopback address .* got '192.0.2.1'"):
        launch(script, 2, host="192.0.2.1")
    with pytest.raises(SystemExit):
        main(["--workers", "0", str(script)])
    with pytest.raises(SystemExit):
        main(["--no-isolation", str(script)])


def test_tf_config_and_cluster_spec():
    ports = free_ports(2)
    cluster = cluster_spec(2, ports=ports)
    assert cluster == {"worker": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"]}
    assert json.loads(tf_config(cluster, 1)) == {"cluster": cluster, "task": {"type": "worker", "index": 1}}
    with pytest.raises(ValueError, match="index must be an int in 0..1"):
        tf_config(cluster, 2)
    with pytest.raises(ValueError, match="no 'chief' job"):
        tf_config(cluster, 0, task_type="chief")


def test_docstring_examples_run():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    tests = [t for name in launch_module.__all__ for t in finder.find(getattr(launch_module, name), name)]
    for test in tests:
        runner.run(test)
    assert runner.failures == 0 and runner.tries >= 5


# --------------------------------------------------------------------------------------
# Network isolation
# --------------------------------------------------------------------------------------

# A worker that listens on its cluster port on every interface, as TensorFlow's server
# does; connects to the next worker over loopback (inside the job: it must work); writes
# what it sees of its network to <out>/worker-<i>.json; and waits for <out>/release.
LISTENER = textwrap.dedent(
    """
    import json, os, pathlib, socket, sys, time
    out = pathlib.Path(sys.argv[1])
    config = json.loads(os.environ["TF_CONFIG"])
    index, addresses = config["task"]["index"], config["cluster"]["worker"]
    port = int(addresses[index].rsplit(":", 1)[1])
    server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    if len(sys.argv) > 2:  # TensorFlow's own server instead of a plain socket
        server.close()
        import tensorflow as tf
        tf_server = tf.distribute.Server(tf.train.ClusterSpec(config["cluster"]), job_name="worker",
                                         task_index=index, start=True)
    host, peer = addresses[(index + 1) % len(addresses)].rsplit(":", 1)
    reached, deadline = False, time.time() + 150  # the peer may still be importing TensorFlow
    while not reached and time.time() < deadline:
        try:
            socket.create_connection((host, int(peer)), timeout=1).close()
            reached = True
        except OSError:
            time.sleep(0.05)
    listening = []
    for name in ("tcp", "tcp6"):
        for line in pathlib.Path("/proc/self/net", name).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                address, hex_port = fields[1].split(":")
                listening.append([name, address, int(hex_port, 16)])
    report = {"index": index, "pid": os.getpid(), "port": port, "reached_peer": reached,
              "namespace": os.readlink("/proc/self/ns/net"),
              "interfaces": [name for _, name in socket.if_nameindex()], "listening": listening}
    (out / f"worker-{index}.tmp").write_text(json.dumps(report))
    (out / f"worker-{index}.tmp").rename(out / f"worker-{index}.json")
    deadline = time.time() + 200  # the test always releases the workers
    while not (out / "release").exists() and time.time() < deadline:
        time.sleep(0.02)
    """
)


def listening_ports_of_this_namespace() -> set[int]:
    """The TCP ports that something listens on in the test's own network namespace."""
    ports = set()
    for name in ("tcp", "tcp6"):
        path = pathlib.Path("/proc/self/net", name)
        if path.exists():
            for line in path.read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":
                    ports.add(int(fields[1].split(":")[1], 16))
    return ports


def run_listeners(tmp_path, workers: int, *extra: str, timeout: float = 30, **options):
    """Launch LISTENER workers; while they listen, look at them from this namespace.

    Returns the launch result, the workers' reports, the ports listening here while they
    ran, and for each worker port whether a connection to 127.0.0.1:port succeeded here.
    """
    script = tmp_path / "listener.py"
    script.write_text(LISTENER)
    out = tmp_path / "out"
    out.mkdir()
    box = {}
    thread = threading.Thread(
        target=lambda: box.update(result=launch(script, workers, [str(out), *extra], timeout=timeout, **options)),
        daemon=True,
    )
    thread.start()
    reports, here, connected = {}, set(), {}
    try:
        deadline = time.monotonic() + timeout
        while len(reports) < workers and thread.is_alive() and time.monotonic() < deadline:
            for index in range(workers):
                path = out / f"worker-{index}.json"
                if index not in reports and path.exists():
                    reports[index] = json.loads(path.read_text())
            time.sleep(0.05)
        if len(reports) == workers:
            here = listening_ports_of_this_namespace()
            for report in reports.values():
                with socket.socket() as probe:  # loopback of this namespace only
                    probe.settimeout(2)
                    connected[report["port"]] = probe.connect_ex(("127.0.0.1", report["port"])) == 0
    finally:
        (out / "release").touch()
        thread.join(timeout + 10)
    assert not thread.is_alive(), "the launch did not return"
    result = box["result"]
    assert len(reports) == workers, outputs(result)
    return result, reports, here, connected


@pytest.mark.skipif(not LINUX, reason="network namespaces are a Linux feature")
def test_network_isolation_is_available_on_linux():
    status = network_isolation()
    assert status.available, status.reason
    assert "namespace with only 'lo'" in status.reason


@pytest.mark.skipif(not LINUX, reason="network namespaces are a Linux feature")
def test_workers_listen_on_every_interface_of_a_namespace_that_has_only_loopback(tmp_path):
    result, reports, here, connected = run_listeners(tmp_path, 2)
    assert result.ok and result.isolated, outputs(result)
    mine = os.readlink("/proc/self/ns/net")
    for report in reports.values():
        assert report["namespace"] == result.network_namespace != mine
        assert report["interfaces"] == ["lo"]
        assert report["reached_peer"]  # the workers reach each other over loopback
        # Inside the job the port is open on every interface (the wildcard address) ...
        assert ["tcp6", "0" * 32, report["port"]] in report["listening"]
    # ... and seen from this machine's own namespace nothing listens there, and a
    # connection to it over this namespace's loopback is refused.
    ports = {report["port"] for report in reports.values()}
    assert not ports & here
    assert connected == {port: False for port in ports}


@pytest.mark.skipif(not LINUX, reason="network namespaces are a Linux feature")
def test_without_isolation_the_same_workers_listen_on_this_machines_network(tmp_path):
    # The contrast, which shows that the test above can fail: (loopback connections only)
    result, reports, here, connected = run_listeners(tmp_path, 2, isolate=False, allow_network_exposure=True)
    assert result.ok and not result.isolated and result.network_namespace is None, outputs(result)
    ports = {report["port"] for report in reports.values()}
    assert all(report["namespace"] == os.readlink("/proc/self/ns/net") for report in reports.values())
    assert ports <= here and connected == {port: True for port in ports}


@pytest.mark.slow
@pytest.mark.skipif(not LINUX, reason="network namespaces are a Linux feature")
def test_tensorflow_servers_listen_on_all_interfaces_but_only_inside_the_job(tmp_path):
    pytest.importorskip("tensorflow")
    result, reports, here, connected = run_listeners(
        tmp_path, 2, "tensorflow", timeout=300, env={"CUDA_VISIBLE_DEVICES": ""}
    )
    assert result.ok and result.isolated, outputs(result)
    for report in reports.values():
        assert report["reached_peer"] and report["interfaces"] == ["lo"]
        # TF_CONFIG names 127.0.0.1, and TensorFlow listens on [::]: every interface.
        assert ["tcp6", "0" * 32, report["port"]] in report["listening"], report["listening"]
    ports = {report["port"] for report in reports.values()}
    assert not ports & here and connected == {port: False for port in ports}


# --- where isolation is unavailable (simulated) --------------------------------------


@pytest.fixture()
def no_namespaces(monkeypatch):
    """This machine as one without user namespaces: the one hook that makes namespaces fails."""

    def unavailable():
        raise launch_network._Unavailable("simulated: the kernel refused a new user namespace")

    monkeypatch.setattr(launch_network, "_create_namespace", unavailable)
    monkeypatch.setattr(launch_network, "_exposure_warned", False)


def test_without_isolation_the_launch_refuses_to_start(no_namespaces, tmp_path):
    marker = tmp_path / "started"
    script = tmp_path / "worker.py"
    script.write_text(f"open({str(marker)!r}, 'a').close()\n")
    with pytest.raises(NetworkIsolationError, match="simulated: the kernel refused") as caught:
        launch(script, 2, timeout=30)
    assert "allow_network_exposure=True" in str(caught.value) and "SECURITY.md" in str(caught.value)
    assert caught.value.reason == "simulated: the kernel refused a new user namespace"
    assert not marker.exists()  # no worker was started


def test_without_isolation_the_opt_in_runs_the_workers_and_warns_once(no_namespaces, script):
    with pytest.warns(RuntimeWarning, match="NOT|not isolated|on this machine's network") as caught:
        result = launch(script, 2, timeout=30, allow_network_exposure=True)
    assert len(caught) == 1 and "simulated: the kernel refused" in str(caught[0].message)
    assert result.ok and not result.isolated and result.network_namespace is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        assert launch(script, 2, timeout=30, allow_network_exposure=True).ok


def test_without_isolation_the_command_line_refuses_unless_allowed(no_namespaces, script, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--workers", "2", str(script)])
    assert exited.value.code == 2
    assert "--allow-network-exposure" in capsys.readouterr().err
    with pytest.warns(RuntimeWarning):
        assert main(["--workers", "2", "--allow-network-exposure", str(script)]) == 0
    out = capsys.readouterr().out
    assert "[launch] WARNING: the workers are NOT isolated: simulated" in out and "[worker 1] cluster" in out
    assert main(["--check-isolation"]) == 1
    assert "not isolated: simulated: the kernel refused" in capsys.readouterr().out


def test_the_environment_variable_makes_namespaces_unavailable(monkeypatch, script):
    # What a notebook kernel or a worker script sees on a machine without namespaces.
    actual = network_isolation().available
    monkeypatch.setenv("COMPANION_NO_NETWORK_NAMESPACES", "1")
    status = network_isolation()
    assert not status.available and "COMPANION_NO_NETWORK_NAMESPACES" in status.reason
    with pytest.raises(NetworkIsolationError) as caught:
        launch(script, 2, timeout=30)
    message = str(caught.value)
    assert "allow_network_exposure=True" in message and "every interface" in message
    assert max(len(line) for line in message.splitlines()) <= 78  # a notebook's width
    monkeypatch.setenv("COMPANION_NO_NETWORK_NAMESPACES", "0")
    assert network_isolation().available == actual  # "0" switches it off again


CHAPTER = ROOT / "book" / "tools" / "training_across_machines.ipynb"


def test_the_chapters_worker_script_ships_with_the_package():
    """The chapter launches companion/book/data/multiworker_train.py: package data (Colab has no
    repository around the installed package), declared in pyproject.toml, valid Python, and
    the script the chapter describes."""
    import fnmatch
    import importlib.resources

    shipped = importlib.resources.files("companion.book") / "data" / "multiworker_train.py"
    text = shipped.read_text(encoding="utf-8")
    compile(text, "multiworker_train.py", "exec")
    for needed in ("MultiWorkerMirroredStrategy()", 'mode == "crash"', "WorkerLostError",
                   'on_nonfinite="raise"', "model.fit("):
        assert needed in text, needed
    # [tool.setuptools.package-data] "companion.book" = [...] (no tomllib on Python 3.10)
    declared = re.search(r'^"companion.book" = \[(.*?)\]', (ROOT / "pyproject.toml").read_text(), re.M)
    patterns = re.findall(r'"([^"]+)"', declared.group(1))
    assert any(fnmatch.fnmatch("data/multiworker_train.py", p) for p in patterns), patterns
    cells = json.loads(CHAPTER.read_text(encoding="utf-8"))["cells"]
    assert any('"multiworker_train.py"' in "".join(c["source"]) for c in cells)  # what it reads


@pytest.mark.slow
def test_the_multiworker_chapter_runs_where_no_private_network_can_be_made(tmp_path):
    """The chapter as a Colab reader without user namespaces runs it: to the end, no error,
    the launches skipped, and the one-line choice printed once."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(CHAPTER, as_version=4)
    notebook.cells = [c for c in notebook.cells if "nbval-skip" not in c.metadata.get("tags", [])]
    env = {"COMPANION_NO_NETWORK_NAMESPACES": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    previous = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        nbclient.NotebookClient(
            notebook, timeout=300, kernel_name="python3",
            resources={"metadata": {"path": str(tmp_path)}},
        ).execute()
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    printed, in_exercises = [], False
    for cell in notebook.cells:
        in_exercises = in_exercises or cell.source.startswith("## Exercises")
        if cell.cell_type == "code" and not in_exercises:
            text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream"
                           and o.name == "stdout")
            printed.append((cell.source, text))
        if cell.cell_type == "code":
            assert not any(o.output_type == "error" for o in cell.outputs), cell.source
    everything = "\n".join(text for _, text in printed)
    assert "the workers can run in a private network here: False" in everything
    assert everything.count("allow_network_exposure=True") == 1  # the choice, once
    launches = [text for source, text in printed if "launch(" in source]
    assert len(launches) == 2 and all(text.startswith("skipped: ") for text in launches)
    assert "epoch losses, one process:" in everything  # what needs no workers still ran
    # no worker ran: no exit codes, no worker's result
    assert "exit codes" not in everything and not re.search(r"^worker \d: ", everything, re.M)


def test_check_isolation_reports_this_machine(capsys):
    status = network_isolation()
    assert main(["--check-isolation"]) == (0 if status.available else 1)
    assert capsys.readouterr().out.startswith("isolated: " if status.available else "not isolated: ")


def test_off_linux_isolation_is_unavailable_and_says_why(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    status = network_isolation()
    assert not status.available and not status
    assert status.reason == "network namespaces are a Linux feature, and this is darwin"


# --------------------------------------------------------------------------------------
# Supervision: who failed first and why; restarting the group
# --------------------------------------------------------------------------------------

# Each worker appends its attempt number and the network namespace it runs in
# ("net:[4026532178]", as the kernel names it) to <out>/attempts-<i>.txt.
FLAKY = textwrap.dedent(
    """
    import json, os, pathlib, sys
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    out = pathlib.Path(sys.argv[1])
    restart = os.environ["COMPANION_RESTART_COUNT"]
    with open(out / f"attempts-{index}.txt", "a") as file:
        file.write(restart + " " + os.readlink("/proc/self/ns/net") + "\\n")
    marker = out / "failed-once"
    if index == 1 and (sys.argv[2] == "always" or not marker.exists()):
        marker.touch()
        sys.exit(1)
    """
)


def flaky(tmp_path, mode: str, **options):
    """Launch FLAKY; returns the result, and per worker its attempt numbers and namespaces."""
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    result = launch(script, 2, [str(tmp_path), mode], timeout=60, grace=5, **options)
    lines = [(tmp_path / f"attempts-{i}.txt").read_text().splitlines() for i in range(2)]
    attempts = [[line.split()[0] for line in worker] for worker in lines]
    namespaces = [[line.split()[1] for line in worker] for worker in lines]
    return result, attempts, namespaces


def assert_every_attempt_ran_isolated(result, namespaces) -> None:
    """Every attempt of the launch, restarts included, ran in a private network namespace.

    Not only what the result says (``isolated``, ``network_namespace``) but what each
    worker saw: its /proc/self/ns/net is its attempt's namespace, not this process's.
    """
    mine = os.readlink("/proc/self/ns/net")
    every = (*result.failed_attempts, result)
    assert all(len(worker) == len(every) for worker in namespaces), (namespaces, result.restarts)
    for number, attempt in enumerate(every):
        assert attempt.isolated, f"attempt {number} ran on this machine's network: {attempt}"
        assert attempt.network_namespace is not None and attempt.network_namespace != mine
        seen = [worker[number] for worker in namespaces]
        assert seen == [attempt.network_namespace] * len(namespaces), (number, seen, mine)


def test_a_group_whose_worker_fails_once_is_restarted_and_then_succeeds(tmp_path):
    result, attempts, namespaces = flaky(tmp_path, "once", max_restarts=2)
    assert result.ok and result.restarts == 1, outputs(result)
    first = result.failed_attempts[0]
    assert first.first_failure.index == 1 and first.first_failure.returncode == 1
    assert first.failure.startswith("worker 1 failed first: exit code 1 after")
    assert attempts == [["0", "1"], ["0", "1"]]  # both workers ran twice, told which attempt
    assert_every_attempt_ran_isolated(result, namespaces)  # the restart too


def test_without_restarts_the_failure_names_the_worker_and_its_exit_code(tmp_path):
    result, attempts, namespaces = flaky(tmp_path, "once")
    assert not result.ok and result.restarts == 0 and attempts == [["0"], ["0"]]
    assert_every_attempt_ran_isolated(result, namespaces)
    assert result.returncode == 1 and result.first_failure.index == 1
    assert result.failure.startswith("worker 1 failed first: exit code 1 after")


def test_restarts_stop_after_max_restarts(tmp_path):
    result, attempts, namespaces = flaky(tmp_path, "always", max_restarts=2)
    assert not result.ok and result.restarts == 2 and result.returncode == 1
    assert attempts == [["0", "1", "2"], ["0", "1", "2"]]
    assert [a.first_failure.index for a in (*result.failed_attempts, result)] == [1, 1, 1]
    assert_every_attempt_ran_isolated(result, namespaces)  # each restart as the first attempt


def test_where_no_namespace_can_be_made_the_allowed_exposure_holds_for_the_restarts_too(no_namespaces, tmp_path):
    # The first attempt ran on this machine's network, by the caller's choice: a restart
    # does the same (after the one warning), rather than failing for want of a namespace.
    with pytest.warns(RuntimeWarning, match="on this machine's network") as caught:
        result, attempts, namespaces = flaky(tmp_path, "once", max_restarts=1, allow_network_exposure=True)
    assert result.ok and result.restarts == 1 and attempts == [["0", "1"], ["0", "1"]], outputs(result)
    assert len(caught) == 1
    assert not any(a.isolated or a.network_namespace for a in (*result.failed_attempts, result))
    assert namespaces == [[os.readlink("/proc/self/ns/net")] * 2] * 2


@pytest.mark.skipif(not LINUX, reason="network namespaces are a Linux feature")
def test_a_restart_that_cannot_be_isolated_raises_instead_of_running_exposed(monkeypatch, tmp_path):
    # The first attempt was isolated, so isolation works here: a restart whose namespace
    # cannot be made is an error, even with allow_network_exposure=True (that accepts a
    # machine without namespaces, not a job that loses its own halfway).
    made = []

    def once():
        if made:
            raise launch_network._Unavailable("simulated: no second namespace")
        made.append(launch_network._Namespace())
        return made[-1]

    monkeypatch.setattr(launch_network, "_create_namespace", once)
    monkeypatch.setattr(launch_network, "_exposure_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no exposure warning either
        with pytest.raises(NetworkIsolationError, match="simulated: no second namespace"):
            flaky(tmp_path, "once", max_restarts=1, allow_network_exposure=True)
    assert len(made) == 1
    for index in range(2):  # the workers ran once, isolated; no restart was started
        lines = (tmp_path / f"attempts-{index}.txt").read_text().splitlines()
        assert lines == [f"0 {made[0].name}"] and made[0].name != os.readlink("/proc/self/ns/net")


def test_a_worker_killed_by_a_signal_is_reported_with_the_signal(script):
    result = launch(script, 2, ["killed"], timeout=30, grace=0.2)
    assert result.first_failure.index == 1 and result.first_failure.signal == signal.SIGKILL
    assert result.failure.startswith("worker 1 failed first: killed by SIGKILL (signal 9) after")
    assert result.returncode == 128 + 9
    assert result.workers[0].reason == "killed by SIGTERM (signal 15), stopped by the launcher"


def test_a_worker_that_ignores_sigterm_is_killed(script, monkeypatch):
    monkeypatch.setattr(launch_supervisor, "_TERMINATE_SECONDS", 0.5)
    result = launch(script, 2, ["stubborn"], timeout=30, grace=0.2)
    assert result.returncodes == [-signal.SIGKILL, 4] and result.workers[0].stopped
    assert result.failure.startswith("worker 1 failed first: exit code 4")
    assert result.seconds < 10


def test_sigterm_to_the_command_line_launcher_stops_every_worker(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        "pathlib.Path(sys.argv[1], f'pid-{os.getpid()}').touch()\n"
        "time.sleep(60)\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "companion.launch", "--workers", "2", str(script), str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("pid-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int(p.name[4:]) for p in tmp_path.glob("pid-*")]
        assert len(pids) == 2
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=15) == 128 + signal.SIGTERM
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert "[launch] terminated: every worker was stopped" in launcher.stderr.read()
    launcher.stderr.close()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} is still running"


# A training script whose worker 1 dies (SIGKILL) after epoch 2 of the first attempt only.
TRAINING = textwrap.dedent(
    """
    import json, os, signal, sys
    import keras
    import numpy as np
    import tensorflow as tf
    from companion.training import train

    out, restart = sys.argv[1], int(os.environ["COMPANION_RESTART_COUNT"])
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    worker = strategy.cluster_resolver.task_id
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype("float32")
    y = x @ np.array([[1.0], [2.0], [-1.0]], "float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.1)
    run = lambda epochs: train(model, data, loss="mse", optimizer=optimizer, epochs=epochs,
                               checkpoint_dir=os.path.join(out, "checkpoints"), verbose=2,
                               jit_compile=False)
    if restart == 0:
        run(2)
        if worker == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    history = run(4)
    with open(os.path.join(out, f"worker-{worker}-restart-{restart}.json"), "w") as file:
        json.dump({"steps": len(history.step_loss), "iterations": int(optimizer.iterations.numpy()),
                   "namespace": os.readlink("/proc/self/ns/net")}, file)
    """
)


@pytest.mark.slow
def test_a_restarted_training_job_resumes_from_its_checkpoint(tmp_path):
    pytest.importorskip("tensorflow")
    script = tmp_path / "train_script.py"
    script.write_text(TRAINING)
    env = {"CUDA_VISIBLE_DEVICES": "", "PYTHONHASHSEED": "0"}
    # Worker 0 then leaves train with WorkerLostError, or is stopped 20 s later: either
    # way the launcher restarts both (how fast a survivor exits is train's business).
    result = launch(script, 2, [str(tmp_path)], timeout=400, grace=20, max_restarts=1, env=env)
    assert result.ok and result.restarts == 1, outputs(result)
    crashed = result.failed_attempts[0]
    assert crashed.first_failure.index == 1 and crashed.first_failure.signal == signal.SIGKILL
    assert crashed.failure.startswith("worker 1 failed first: killed by SIGKILL (signal 9)")
    assert crashed.workers[0].returncode != 0
    # The restart ran epochs 3 and 4 only, after the checkpoint of epoch 2.
    epochs = [line for line in result.workers[0].output.splitlines() if line.startswith("Epoch ")]
    assert epochs == ["Epoch 3/4", "Epoch 4/4"], result.workers[0].output[-2000:]
    # Both attempts in a private network; the restart's workers in the one it reports.
    assert crashed.isolated and result.isolated and result.network_namespace != os.readlink("/proc/self/ns/net")
    for index in range(2):
        report = json.loads((tmp_path / f"worker-{index}-restart-1.json").read_text())
        assert report == {"steps": 4 * 4, "iterations": 4 * 4, "namespace": result.network_namespace}
