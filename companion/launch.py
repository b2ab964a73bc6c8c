"""Start and supervise the workers of a multi-worker TensorFlow job on this machine.

``tf.distribute.MultiWorkerMirroredStrategy`` learns where it runs from the ``TF_CONFIG``
environment variable: a JSON object with the addresses of all workers (the *cluster*) and
the index of the current one (the *task*)::

    {"cluster": {"worker": ["127.0.0.1:23456", "127.0.0.1:23457"]},
     "task": {"type": "worker", "index": 0}}

Every worker runs the same script with its own ``TF_CONFIG``; worker 0 is the *chief*.
On a cluster, a job scheduler (Kubernetes, Slurm, ...) sets ``TF_CONFIG`` on each
machine. :func:`launch` does it on one machine, to try a script out::

    python -m companion.launch --workers 2 train_script.py --epochs 3

**What the workers expose.** Each worker starts TensorFlow's gRPC server, which listens
on *every* interface of its network (``*:port``), whatever host the cluster names:
``127.0.0.1`` in ``TF_CONFIG`` does not keep it on the loopback interface. That server
has no authentication and runs the graphs it is sent, so TensorFlow's security guide
(``SECURITY.md``, "Running a TensorFlow server") requires the cluster to live in an
isolated network: anybody who can reach the port can run code as the worker. Therefore,
on Linux, :func:`launch` runs the workers in a network of their own: a new, unprivileged
user and network namespace (what ``unshare --user --map-current-user --net`` makes),
whose only interface is the loopback ``lo``. The workers reach each other there, and
nothing outside the job can reach them, not even a process of the same machine;
:attr:`LaunchResult.isolated` and :func:`network_isolation` say whether that happened.
The price: the workers have no other network either (no downloads, no ``gs://``
checkpoints); fetch data before the launch. Where no such namespace can be made (macOS,
Windows, a kernel or container without user namespaces), :func:`launch` refuses to
start unless given ``allow_network_exposure=True`` (``--allow-network-exposure``), and
then warns once. To try a script (or the chapter) as it runs on such a machine, set the
environment variable ``COMPANION_NO_NETWORK_NAMESPACES=1``: namespaces then count as
unavailable.

**Supervision**, as ``torchrun`` does it: the output of worker ``i`` is kept (and printed
with the prefix ``[worker i]`` by the command line); when a worker fails, the others get
``grace`` seconds to exit by themselves (a worker of a synchronous job notices a lost peer
at its next collective, see :func:`companion.training.train`) and are then stopped
(SIGTERM, then SIGKILL); the result says which worker failed first and how. With
``max_restarts`` > 0 the whole group is then started again, at most that many times: a
script that trains with ``checkpoint_dir`` resumes after its last completed epoch.
Ctrl-C, SIGTERM to the command-line launcher, and ``timeout`` stop every worker.

One machine has one set of devices: on a machine with a GPU, give each worker its own
(``CUDA_VISIBLE_DEVICES``) or none (``CUDA_VISIBLE_DEVICES=""``), or the workers compete
for the same memory.

Derived in the chapter *Training across machines* (``book/tools/training_across_machines``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from typing import Any, Mapping, Sequence

from companion._checks import check_int

__all__ = [
    "LaunchResult",
    "NetworkIsolation",
    "NetworkIsolationError",
    "WorkerResult",
    "cluster_spec",
    "free_ports",
    "launch",
    "main",
    "network_isolation",
    "tf_config",
]

#: Seconds a stopped worker gets between SIGTERM and SIGKILL.
_TERMINATE_SECONDS = 3.0
#: Environment variable that tells a worker how many times its group was restarted.
RESTART_COUNT_VARIABLE = "COMPANION_RESTART_COUNT"


# The results of a launch, and the cluster's addresses, are in companion._workers.
from companion._workers import (  # noqa: E402
    TIMEOUT_EXIT_CODE,
    LaunchResult,
    WorkerResult,
    cluster_spec,
    free_ports,
    tf_config,
)


# --------------------------------------------------------------------------------------
# Network isolation
# --------------------------------------------------------------------------------------


# The namespaces themselves (the helper process, joining them) are in companion._netns.
from companion._netns import (  # noqa: E402
    NetworkIsolation,
    NetworkIsolationError,
    _Namespace,
    _Unavailable,
)


def _create_namespace() -> _Namespace:
    """A new private network namespace; raises ``_Unavailable`` with the reason if impossible.

    The one place where isolation is attempted: a test simulates a machine without
    namespaces by replacing this function with one that raises ``_Unavailable``.
    """
    return _Namespace()


def network_isolation() -> NetworkIsolation:
    """Whether :func:`launch` can run workers in a private, loopback-only network here.

    It tries: it makes such a namespace (a new unprivileged user and network namespace on
    Linux) and removes it again, in a few milliseconds. With the environment variable
    ``COMPANION_NO_NETWORK_NAMESPACES=1`` it reports them unavailable without trying.

    Returns:
        A :class:`NetworkIsolation`: ``available``, and how or why not (``reason``).

    Example:
        >>> status = network_isolation()
        >>> status.available in (True, False) and bool(status.reason)
        True
    """
    try:
        namespace = _create_namespace()
    except _Unavailable as error:
        return NetworkIsolation(False, str(error))
    description = namespace.description
    namespace.close()
    return NetworkIsolation(True, description)


_exposure_warned = False


def _warn_exposure(reason: str) -> None:
    global _exposure_warned
    if _exposure_warned:
        return
    _exposure_warned = True
    warnings.warn(
        f"companion.launch: the workers run on this machine's network, because no private "
        f"network can be made here ({reason}). Their TensorFlow servers listen on every "
        "interface, without authentication, and run the graphs they are sent: anybody who "
        "can reach their ports can run code as the workers (TensorFlow's SECURITY.md). "
        "Block the ports with a firewall, or use a trusted network only. (Warned once.)",
        RuntimeWarning,
        stacklevel=3,
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
    :class:`NetworkIsolationError` is raised, unless ``allow_network_exposure=True``:
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
    if isolate and not _is_loopback(host):
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
                namespace = _create_namespace()
            except _Unavailable as error:
                if failed:  # it worked for the first attempt: not a property of the machine
                    raise NetworkIsolationError(str(error)) from None
                if not allow_network_exposure:
                    raise NetworkIsolationError(str(error)) from None
                if echo:
                    print(f"[launch] WARNING: the workers are NOT isolated: {error}", flush=True)
                _warn_exposure(str(error))
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


def _check_count(name: str, value: Any) -> int:
    return check_int(name, value, 1)


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


# --------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------

_DESCRIPTION = """\
Run a script as N local workers of a MultiWorkerMirroredStrategy cluster (TF_CONFIG on
127.0.0.1), and supervise them: when one fails, stop the others after --grace seconds
and, with --max-restarts, start them all again.

Network: TensorFlow's server listens on every interface (*:port), whatever host TF_CONFIG
names, has no authentication and runs the graphs it is sent; TensorFlow's SECURITY.md
requires an isolated network. So on Linux the workers run in a private network namespace
whose only interface is loopback: nothing outside the job can reach them (and they cannot
reach any other network). Where that is impossible the launcher refuses to start, unless
given --allow-network-exposure. --check-isolation says which case this machine is.
"""


class _Terminated(KeyboardInterrupt):
    """The command-line launcher received SIGTERM."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m companion.launch --workers N script.py [args...]``.

    ``python -m companion.launch --check-isolation`` says whether the workers can be
    isolated here (exit code 0) or not (1), and why.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        0 if every worker exited with 0, else the exit code of the first one that failed
        (``128 + signal`` for a worker ended by a signal; 124 if ``--timeout`` expired;
        130 on Ctrl-C, 143 on SIGTERM); 2 for bad arguments and when the workers cannot
        be isolated without ``--allow-network-exposure``.
    """
    parser = argparse.ArgumentParser(
        prog="python -m companion.launch",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workers", type=int, default=2, help="number of workers (default: 2)")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the workers connect to (default: 127.0.0.1); they listen on all interfaces",
    )
    parser.add_argument(
        "--port-base", type=int, default=None, help="worker i listens on PORT_BASE + i (default: free ports)"
    )
    parser.add_argument("--timeout", type=float, default=None, help="stop every worker after this many seconds")
    parser.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="after a worker failed, seconds the others get to exit by themselves (default: 30)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="after a failure, start the whole group again up to this many times (default: 0); "
        "a script that trains with checkpoint_dir resumes from its last checkpoint",
    )
    parser.add_argument(
        "--allow-network-exposure",
        action="store_true",
        help="where the workers cannot be isolated, run them on this machine's network anyway "
        "(their servers are then reachable by anyone who reaches their ports)",
    )
    parser.add_argument(
        "--no-isolation",
        action="store_true",
        help="run the workers on this machine's network even where they could be isolated "
        "(needs --allow-network-exposure)",
    )
    parser.add_argument(
        "--check-isolation",
        action="store_true",
        help="only say whether the workers can be isolated here, and why (exit code 0 if so, else 1)",
    )
    parser.add_argument("script", nargs="?", help="the Python script every worker runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")
    options = parser.parse_args(argv)
    if options.check_isolation:
        status = network_isolation()
        if status.available:
            print(f"isolated: the workers would run in {status.reason}")
        else:
            print(f"not isolated: {status.reason}")
        return 0 if status.available else 1
    if options.script is None:
        parser.error("the script is required (or --check-isolation)")
    if options.workers < 1:
        parser.error(f"--workers must be >= 1, got {options.workers}")
    if options.no_isolation and not options.allow_network_exposure:
        parser.error("--no-isolation exposes the workers' servers: it needs --allow-network-exposure too")
    ports = None
    if options.port_base is not None:
        ports = list(range(options.port_base, options.port_base + options.workers))
        if not (0 < ports[0] and ports[-1] < 65536):
            parser.error(f"--port-base {options.port_base} gives ports outside 1..65535")
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        result = launch(
            options.script,
            options.workers,
            options.args,
            timeout=options.timeout,
            grace=options.grace,
            max_restarts=options.max_restarts,
            host=options.host,
            ports=ports,
            echo=True,
            isolate=not options.no_isolation,
            allow_network_exposure=options.allow_network_exposure,
        )
    except (FileNotFoundError, ValueError, TypeError, NetworkIsolationError) as error:
        parser.error(str(error))
    except KeyboardInterrupt as interrupt:
        how = "terminated" if isinstance(interrupt, _Terminated) else "interrupted"
        print(f"[launch] {how}: every worker was stopped", file=sys.stderr)
        return 128 + signal.SIGTERM if isinstance(interrupt, _Terminated) else 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    for worker in result.workers:
        how = "stopped by the launcher, " if worker.stopped else ""
        print(
            f"[launch] worker {worker.index} exited with code {worker.returncode} ({how}{worker.seconds:.1f} s)",
            file=sys.stderr,
        )
    if result.failure:
        print(f"[launch] {result.failure}", file=sys.stderr)
    if result.timed_out:
        print(f"[launch] timeout of {options.timeout:g} s expired", file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
