"""Start the workers of one ``TF_CONFIG`` cluster on this machine and supervise them.

:func:`launch` runs a script as N workers, in a private network when
:mod:`companion.launch.network` can make one, and stops or restarts the group when one
fails (see :mod:`companion.launch`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Mapping, Sequence

from companion._checks import check_int
from companion.launch import network
from companion.launch.workers import (
    _check_count,
    LaunchResult,
    WorkerResult,
    cluster_spec,
    tf_config,
)

#: Seconds a stopped worker gets between SIGTERM and SIGKILL.
_TERMINATE_SECONDS = 3.0
#: Environment variable that tells a worker how many times its group was restarted.
RESTART_COUNT_VARIABLE = "COMPANION_RESTART_COUNT"


# --------------------------------------------------------------------------------------
# launch
# --------------------------------------------------------------------------------------


def launch(
    script: str | os.PathLike,
    workers: int = 2,
    args: Sequence[str] = (),
    *,
    timeout: float | None = None,
    grace: float = 30.0,
    max_restarts: int = 0,
    env: Mapping[str, str] | None = None,
    host: str = "127.0.0.1",
    ports: Sequence[int] | None = None,
    echo: bool = False,
    cwd: str | os.PathLike | None = None,
    python: str | None = None,
    isolate: bool = True,
    allow_network_exposure: bool = False,
) -> LaunchResult:
    """Run ``python script *args`` as ``workers`` local workers of one ``TF_CONFIG`` cluster.

    Each worker is a new process with the environment of this one, plus ``env``, plus
    ``TF_CONFIG`` (its task index is its position in the cluster, worker 0 being the
    chief), ``COMPANION_RESTART_COUNT`` (0, then 1 after the first restart, ...) and
    ``PYTHONUNBUFFERED=1``; ``TF_CPP_MIN_LOG_LEVEL`` defaults to ``2``.

    Network: every worker's TensorFlow server listens on all interfaces (``*:port``),
    whatever ``host`` says, and runs any graph it is sent (see the module's
    documentation). So by default (``isolate=True``) the workers run in a new network
    namespace whose only interface is the loopback ``lo`` (Linux; a new unprivileged user
    namespace makes it possible without root): they reach each other, nothing outside the
    job reaches them, and they reach nothing else. Where that is impossible,
    :class:`~companion.launch.NetworkIsolationError` is raised, unless ``allow_network_exposure=True``:
    then the workers run on this machine's network, after a warning (once per process).

    Supervision: the call returns when every worker has exited. When one exits with a
    non-zero code, the others get ``grace`` seconds to exit by themselves and are then
    stopped (SIGTERM, then SIGKILL 3 s later). If restarts are left (``max_restarts``),
    all workers are then started again, in a new namespace; a script that trains with
    ``checkpoint_dir`` resumes from its last checkpoint. When ``timeout`` expires, or on
    Ctrl-C, all are stopped and nothing is restarted (Ctrl-C is re-raised after that).

    Args:
        script: path of the Python script every worker runs.
        workers: number of workers, >= 1.
        args: command-line arguments passed to every worker's script.
        timeout: seconds after which the workers still running are stopped, counted from
            the start of the launch, restarts included; ``None`` waits for ever.
        grace: seconds the other workers get, after one failed, to exit by themselves.
        max_restarts: how many times the whole group may be restarted after a failure.
        env: extra environment variables of the workers (e.g. ``{"CUDA_VISIBLE_DEVICES": ""}``).
        host: the address the workers connect to each other at (they *listen* on every
            interface); must be a loopback address when ``isolate``.
        ports: one port per worker; default: free ports.
        echo: print every line the workers write, prefixed with ``[worker i]``, as it
            comes, and what the launcher does, prefixed with ``[launch]``.
        cwd: working directory of the workers; default: the current one.
        python: the interpreter; default: the one running this function.
        isolate: run the workers in a private network namespace (see above). ``False``
            runs them on this machine's network, and needs ``allow_network_exposure``.
        allow_network_exposure: accept that the workers' servers are reachable from this
            machine's network when they cannot be isolated (or ``isolate=False``).

    Returns:
        A :class:`LaunchResult` with every worker's exit code and output, who failed
        first (:attr:`~LaunchResult.failure`), whether the network was isolated, and the
        earlier attempts if the group was restarted.

    Raises:
        ValueError: if ``workers`` < 1, ``timeout`` or ``grace`` is negative,
            ``max_restarts`` < 0, ``ports`` is not one free port per worker, ``host`` is
            not a loopback address while ``isolate``, or ``isolate=False`` without
            ``allow_network_exposure=True``.
        TypeError: if ``workers`` or ``max_restarts`` is not an int, or ``args`` is a
            string.
        FileNotFoundError: if ``script`` does not exist.
        NetworkIsolationError: if ``isolate`` and no private network can be made here,
            without ``allow_network_exposure=True``.

    Example:
        >>> result = launch("train_script.py", workers=2, timeout=300)  # doctest: +SKIP
        >>> result.ok, result.returncodes, result.isolated  # doctest: +SKIP
        (True, [0, 0], True)
    """
    workers = _check_count("workers", workers)
    script = os.fspath(script)
    if not os.path.isfile(script):
        raise FileNotFoundError(f"script not found: {script!r}")
    for name, value in (("timeout", timeout), ("grace", grace)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"{name} must be a number >= 0{' or None' if name == 'timeout' else ''}, got {value!r}")
    check_int("max_restarts", max_restarts, 0)
    if isinstance(args, (str, bytes)):
        raise TypeError(f"args must be a sequence of strings, e.g. ['--epochs', '3'], got the string {args!r}")
    if not isolate and not allow_network_exposure:
        raise ValueError(
            "isolate=False runs the workers' TensorFlow servers on this machine's network, where "
            "anybody who reaches their ports can run code as them; pass "
            "allow_network_exposure=True as well to do that"
        )
    if isolate and not network._is_loopback(host):
        raise ValueError(
            f"host must be a loopback address (e.g. '127.0.0.1') when the workers run in a "
            f"private network, which has only the loopback interface; got {host!r}"
        )
    args = [os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in args]
    cluster = cluster_spec(workers, host=host, ports=ports)
    command = [python or sys.executable, script, *args]
    base_env = {**os.environ, **(env or {})}
    base_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    base_env["PYTHONUNBUFFERED"] = "1"

    started = time.monotonic()
    failed: list[LaunchResult] = []
    while True:
        namespace = None
        if isolate and (failed == [] or failed[-1].isolated):
            try:
                namespace = network._create_namespace()
            except network._Unavailable as error:
                if failed:  # it worked for the first attempt: not a property of the machine
                    raise network.NetworkIsolationError(str(error)) from None
                if not allow_network_exposure:
                    raise network.NetworkIsolationError(str(error)) from None
                if echo:
                    print(f"[launch] WARNING: the workers are NOT isolated: {error}", flush=True)
                network._warn_exposure(str(error))
        if echo:
            where = f"in {namespace.description} ({namespace.name})" if namespace else "on this machine's network"
            print(f"[launch] starting {workers} worker{'s' if workers > 1 else ''} {where}", flush=True)
        try:
            attempt = _run_group(
                command, cluster, base_env, len(failed), namespace, started, timeout, grace, echo, cwd
            )
        finally:
            if namespace is not None:
                namespace.close()
        out_of_time = timeout is not None and time.monotonic() - started >= timeout
        if attempt.ok or attempt.timed_out or out_of_time or len(failed) >= max_restarts:
            return dataclasses.replace(attempt, failed_attempts=tuple(failed))
        failed.append(attempt)
        if echo:
            print(
                f"[launch] {attempt.failure}; restarting all workers (restart {len(failed)} of {max_restarts})",
                flush=True,
            )


def _run_group(command, cluster, base_env, restart, namespace, started, timeout, grace, echo, cwd) -> LaunchResult:
    """Start one attempt of every worker and supervise it until all have exited."""
    workers = len(cluster["worker"])
    lock = threading.Lock()
    outputs: list[list[str]] = [[] for _ in range(workers)]
    processes: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []
    group_started = time.monotonic()
    try:
        for index in range(workers):
            worker_env = dict(base_env)
            worker_env["TF_CONFIG"] = tf_config(cluster, index)
            worker_env[RESTART_COUNT_VARIABLE] = str(restart)
            argv, fds = namespace.command(command) if namespace is not None else (command, ())
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=worker_env,
                cwd=cwd,
                text=True,
                errors="replace",
                bufsize=1,
                pass_fds=fds,
                start_new_session=True,  # the launcher, not the terminal, stops the workers
            )
            processes.append(process)
            reader = threading.Thread(
                target=_read_lines, args=(process.stdout, outputs[index], index, echo, lock), daemon=True
            )
            reader.start()
            readers.append(reader)
        deadline = None if timeout is None else started + timeout
        ended, stopped, timed_out = _wait(processes, deadline, grace)
    except BaseException:
        _stop([p for p in processes if p.poll() is None])
        for reader in readers:
            reader.join(timeout=5)
        raise
    for reader in readers:
        reader.join(timeout=5)
    results = tuple(
        WorkerResult(
            index=index,
            returncode=process.returncode,
            output="".join(outputs[index]),
            seconds=ended[index] - group_started,
            stopped=index in stopped,
        )
        for index, process in enumerate(processes)
    )
    return LaunchResult(
        results,
        cluster,
        max(ended) - started,
        timed_out,
        isolated=namespace is not None,
        network_namespace=namespace.name if namespace is not None else None,
    )


def _read_lines(stream, sink: list[str], index: int, echo: bool, lock: threading.Lock) -> None:
    for line in stream:
        sink.append(line)
        if echo:
            with lock:
                print(f"[worker {index}] {line}", end="" if line.endswith("\n") else "\n", flush=True)
    stream.close()


def _wait(processes, deadline: float | None, grace: float) -> tuple[list[float], set[int], bool]:
    """Poll until every process exited; stop the rest after a failure's grace period or the deadline."""
    ended: list[float | None] = [None] * len(processes)
    stopped: set[int] = set()
    failed_at = None
    while True:
        now = time.monotonic()
        for index, process in enumerate(processes):
            if ended[index] is None and process.poll() is not None:
                ended[index] = now
                if process.returncode != 0 and failed_at is None:
                    failed_at = now
        running = [i for i, t in enumerate(ended) if t is None]
        if not running:
            return ended, stopped, False
        expired = deadline is not None and now > deadline
        if expired or (failed_at is not None and now - failed_at > grace):
            stopped.update(running)
            _stop([processes[i] for i in running])
            now = time.monotonic()
            for index in running:
                ended[index] = now
            return ended, stopped, expired
        time.sleep(0.02)


def _signal_group(process: subprocess.Popen, kill: bool) -> None:
    """SIGTERM (or SIGKILL) the worker and whatever it started (its own session), if it runs."""
    if process.poll() is not None:
        return
    if hasattr(os, "killpg"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL if kill else signal.SIGTERM)
            return
    with contextlib.suppress(ProcessLookupError):
        process.kill() if kill else process.terminate()


def _stop(processes) -> None:
    """SIGTERM every process, and SIGKILL those still running after ``_TERMINATE_SECONDS``."""
    for process in processes:
        _signal_group(process, kill=False)
    deadline = time.monotonic() + _TERMINATE_SECONDS
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            _signal_group(process, kill=True)
            process.wait()
