"""Start the workers of a multi-worker TensorFlow job on this machine, to try it out.

``tf.distribute.MultiWorkerMirroredStrategy`` learns where it runs from the ``TF_CONFIG``
environment variable: a JSON object with the addresses of all workers (the *cluster*) and
the index of the current one (the *task*)::

    {"cluster": {"worker": ["127.0.0.1:23456", "127.0.0.1:23457"]},
     "task": {"type": "worker", "index": 0}}

Every worker runs the same script with its own ``TF_CONFIG``; worker 0 is the *chief*.
On a cluster, a job scheduler (Kubernetes, Slurm, ...) sets ``TF_CONFIG`` on each
machine. :func:`launch` does it on one machine, with every worker on ``127.0.0.1`` and a
free port, so that nothing leaves the loopback interface::

    python -m companion.launch --workers 2 train_script.py --epochs 3

The output of worker ``i`` is printed with the prefix ``[worker i]``. The launcher's exit
code is 0 if every worker exited with 0; if a worker fails, the others get ``--grace``
seconds to exit by themselves (a worker of a synchronous job notices a lost peer at its
next collective, see :func:`companion.training.train`) and are then stopped; Ctrl-C and
``--timeout`` stop all of them.

One machine has one set of devices: on a machine with a GPU, give each worker its own
(``CUDA_VISIBLE_DEVICES``) or none (``CUDA_VISIBLE_DEVICES=""``), or the workers compete
for the same memory.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Mapping, Sequence

__all__ = ["LaunchResult", "WorkerResult", "cluster_spec", "free_ports", "launch", "main", "tf_config"]

#: Seconds a stopped worker gets between SIGTERM and SIGKILL.
_TERMINATE_SECONDS = 3.0
#: Exit code of the command-line launcher when ``--timeout`` expired (as ``timeout(1)``).
TIMEOUT_EXIT_CODE = 124


@dataclasses.dataclass(frozen=True)
class WorkerResult:
    """How one worker process ended.

    Attributes:
        index: the worker's task index (``TF_CONFIG["task"]["index"]``); 0 is the chief.
        returncode: its exit code; negative if it was ended by a signal (``-9``: killed).
        output: everything it wrote to stdout and stderr, interleaved, without prefixes.
        seconds: time from the start of the launch until it exited.
        stopped: ``True`` if the launcher stopped it (another worker failed and the grace
            period expired, the timeout expired, or Ctrl-C).
    """

    index: int
    returncode: int
    output: str
    seconds: float
    stopped: bool = False

    @property
    def ok(self) -> bool:
        """Whether the worker exited with code 0."""
        return self.returncode == 0


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """The outcome of :func:`launch`.

    Attributes:
        workers: one :class:`WorkerResult` per worker, in task order.
        cluster: the cluster the workers were given (``{"worker": ["host:port", ...]}``).
        seconds: wall time from the start of the first worker until the last one exited.
        timed_out: whether the launch's ``timeout`` expired (the workers still running
            were then stopped).
    """

    workers: tuple[WorkerResult, ...]
    cluster: dict[str, list[str]]
    seconds: float
    timed_out: bool = False

    @property
    def returncodes(self) -> list[int]:
        """The exit code of every worker, in task order."""
        return [worker.returncode for worker in self.workers]

    @property
    def ok(self) -> bool:
        """Whether every worker exited with code 0 (and the timeout did not expire)."""
        return not self.timed_out and all(worker.ok for worker in self.workers)

    @property
    def first_failure(self) -> WorkerResult | None:
        """The worker that failed first (by exit time), excluding workers the launcher stopped."""
        failed = [w for w in self.workers if not w.ok and not w.stopped] or [w for w in self.workers if not w.ok]
        return min(failed, key=lambda w: w.seconds) if failed else None

    @property
    def returncode(self) -> int:
        """The exit code of the whole job, 0 if :attr:`ok`, else that of the first failure.

        A worker ended by a signal ``s`` counts as ``128 + s`` (as in a shell), an expired
        timeout as 124.
        """
        if self.ok:
            return 0
        if self.timed_out:
            return TIMEOUT_EXIT_CODE
        code = self.first_failure.returncode
        return 128 - code if code < 0 else code

    def __str__(self) -> str:
        parts = [f"worker {w.index}: exit {w.returncode} after {w.seconds:.1f} s" for w in self.workers]
        timed_out = ", timed out" if self.timed_out else ""
        return f"LaunchResult({'; '.join(parts)}{timed_out})"


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports on ``host`` that are free right now.

    The operating system picks them (a bind to port 0); they are released before this
    function returns, so another program could take one in between: fine on a test
    machine, not a reservation.

    Args:
        count: how many ports, >= 1.
        host: the interface to bind.

    Returns:
        The port numbers.

    Raises:
        ValueError: if ``count`` < 1.
    """
    count = _check_count("count", count)
    with contextlib.ExitStack() as stack:
        sockets = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]


def cluster_spec(workers: int, *, host: str = "127.0.0.1", ports: Sequence[int] | None = None) -> dict[str, list[str]]:
    """The ``cluster`` part of ``TF_CONFIG`` for ``workers`` workers on one host.

    Args:
        workers: number of workers, >= 1.
        host: their address; the default keeps every connection on the loopback interface.
        ports: one port per worker; default: free ports (:func:`free_ports`).

    Returns:
        ``{"worker": ["host:port", ...]}``.

    Raises:
        ValueError: if ``workers`` < 1 or ``ports`` does not hold ``workers`` distinct
            ports in 1..65535.
    """
    workers = _check_count("workers", workers)
    if ports is None:
        ports = free_ports(workers, host)
    ports = list(ports)
    if len(ports) != workers or len(set(ports)) != workers:
        raise ValueError(f"ports must hold {workers} distinct ports (one per worker), got {ports}")
    for port in ports:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"ports must be integers in 1..65535, got {port!r}")
    return {"worker": [f"{host}:{port}" for port in ports]}


def tf_config(cluster: Mapping[str, Sequence[str]], index: int, task_type: str = "worker") -> str:
    """The ``TF_CONFIG`` value (a JSON string) of task ``index`` of ``cluster``.

    Args:
        cluster: e.g. ``{"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]}``.
        index: the task index of this process within ``cluster[task_type]``.
        task_type: the job name, ``"worker"`` for ``MultiWorkerMirroredStrategy``.

    Returns:
        ``'{"cluster": {...}, "task": {"type": "worker", "index": 0}}'``.

    Raises:
        ValueError: if ``cluster`` has no job ``task_type`` or ``index`` is out of range.
    """
    tasks = cluster.get(task_type)
    if not tasks:
        raise ValueError(f"cluster has no {task_type!r} job: {dict(cluster)}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(tasks):
        raise ValueError(f"index must be an int in 0..{len(tasks) - 1}, got {index!r}")
    config = {"cluster": {k: list(v) for k, v in cluster.items()}, "task": {"type": task_type, "index": index}}
    return json.dumps(config)


def launch(
    script: str | os.PathLike,
    workers: int = 2,
    args: Sequence[str] = (),
    *,
    timeout: float | None = None,
    grace: float = 30.0,
    env: Mapping[str, str] | None = None,
    host: str = "127.0.0.1",
    ports: Sequence[int] | None = None,
    echo: bool = False,
    cwd: str | os.PathLike | None = None,
    python: str | None = None,
) -> LaunchResult:
    """Run ``python script *args`` as ``workers`` local workers of one ``TF_CONFIG`` cluster.

    Each worker is a new process with the environment of this one, plus ``env``, plus
    ``TF_CONFIG`` (its task index is its position in the cluster, worker 0 being the
    chief) and ``PYTHONUNBUFFERED=1``; ``TF_CPP_MIN_LOG_LEVEL`` defaults to ``2``.
    The call returns when every worker has exited. When one exits with a non-zero code,
    the others get ``grace`` seconds to exit by themselves and are then stopped (SIGTERM,
    then SIGKILL); when ``timeout`` expires, or on Ctrl-C, all are stopped (Ctrl-C is
    re-raised after that).

    Args:
        script: path of the Python script every worker runs.
        workers: number of workers, >= 1.
        args: command-line arguments passed to every worker's script.
        timeout: seconds after which the workers still running are stopped; ``None``
            waits for ever.
        grace: seconds the other workers get, after one failed, to exit by themselves.
        env: extra environment variables of the workers (e.g. ``{"CUDA_VISIBLE_DEVICES": ""}``).
        host: the address the workers listen on.
        ports: one port per worker; default: free ports.
        echo: print every line the workers write, prefixed with ``[worker i]``, as it comes.
        cwd: working directory of the workers; default: the current one.
        python: the interpreter; default: the one running this function.

    Returns:
        A :class:`LaunchResult` with every worker's exit code and output.

    Raises:
        ValueError: if ``workers`` < 1, ``timeout`` or ``grace`` is negative, or ``ports``
            is not one free port per worker.
        FileNotFoundError: if ``script`` does not exist.

    Example:
        >>> result = launch("train_script.py", workers=2, timeout=300)  # doctest: +SKIP
        >>> result.ok, result.returncodes  # doctest: +SKIP
        (True, [0, 0])
    """
    workers = _check_count("workers", workers)
    script = os.fspath(script)
    if not os.path.isfile(script):
        raise FileNotFoundError(f"script not found: {script!r}")
    for name, value in (("timeout", timeout), ("grace", grace)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"{name} must be a number >= 0{' or None' if name == 'timeout' else ''}, got {value!r}")
    if isinstance(args, (str, bytes)):
        raise TypeError(f"args must be a sequence of strings, e.g. ['--epochs', '3'], got the string {args!r}")
    args = [os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in args]
    cluster = cluster_spec(workers, host=host, ports=ports)
    command = [python or sys.executable, script, *args]

    lock = threading.Lock()
    outputs: list[list[str]] = [[] for _ in range(workers)]
    processes: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []
    started = time.monotonic()
    try:
        for index in range(workers):
            worker_env = {**os.environ, **(env or {})}
            worker_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
            worker_env["PYTHONUNBUFFERED"] = "1"
            worker_env["TF_CONFIG"] = tf_config(cluster, index)
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=worker_env,
                cwd=cwd,
                text=True,
                errors="replace",
                bufsize=1,
                start_new_session=True,  # the launcher, not the terminal, stops the workers
            )
            processes.append(process)
            reader = threading.Thread(
                target=_read_lines, args=(process.stdout, outputs[index], index, echo, lock), daemon=True
            )
            reader.start()
            readers.append(reader)
        ended, stopped, timed_out = _wait(processes, started, timeout, grace)
    except BaseException:
        _stop(processes, [p for p in processes if p.poll() is None])
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
            seconds=ended[index] - started,
            stopped=index in stopped,
        )
        for index, process in enumerate(processes)
    )
    return LaunchResult(results, cluster, max(ended) - started, timed_out)


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _read_lines(stream, sink: list[str], index: int, echo: bool, lock: threading.Lock) -> None:
    for line in stream:
        sink.append(line)
        if echo:
            with lock:
                print(f"[worker {index}] {line}", end="" if line.endswith("\n") else "\n", flush=True)
    stream.close()


def _wait(processes, started: float, timeout: float | None, grace: float) -> tuple[list[float], set[int], bool]:
    """Poll until every process exited; stop the rest after a failure's grace period or the timeout."""
    ended: list[float | None] = [None] * len(processes)
    stopped: set[int] = set()
    failed_at = None
    timed_out = False
    while True:
        now = time.monotonic()
        for index, process in enumerate(processes):
            if ended[index] is None and process.poll() is not None:
                ended[index] = now
                if process.returncode != 0 and failed_at is None:
                    failed_at = now
        running = [i for i, t in enumerate(ended) if t is None]
        if not running:
            return ended, stopped, timed_out
        expired = timeout is not None and now - started > timeout
        if expired or (failed_at is not None and now - failed_at > grace):
            timed_out = timed_out or expired
            stopped.update(running)
            _stop(processes, [processes[i] for i in running])
            now = time.monotonic()
            for index in running:
                ended[index] = now
            return ended, stopped, timed_out
        time.sleep(0.02)


def _stop(all_processes, processes) -> None:
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
    deadline = time.monotonic() + _TERMINATE_SECONDS
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m companion.launch --workers N script.py [args...]``.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        0 if every worker exited with 0, else the exit code of the first one that failed
        (``128 + signal`` for a worker ended by a signal; 124 if ``--timeout`` expired;
        130 on Ctrl-C).
    """
    parser = argparse.ArgumentParser(
        prog="python -m companion.launch",
        description="Run a script as N local workers of a MultiWorkerMirroredStrategy cluster "
        "(TF_CONFIG on 127.0.0.1).",
    )
    parser.add_argument("--workers", type=int, default=2, help="number of workers (default: 2)")
    parser.add_argument("--host", default="127.0.0.1", help="address of every worker (default: 127.0.0.1)")
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
    parser.add_argument("script", help="the Python script every worker runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")
    options = parser.parse_args(argv)
    if options.workers < 1:
        parser.error(f"--workers must be >= 1, got {options.workers}")
    ports = None
    if options.port_base is not None:
        ports = list(range(options.port_base, options.port_base + options.workers))
        if not (0 < ports[0] and ports[-1] < 65536):
            parser.error(f"--port-base {options.port_base} gives ports outside 1..65535")
    try:
        result = launch(
            options.script,
            options.workers,
            options.args,
            timeout=options.timeout,
            grace=options.grace,
            host=options.host,
            ports=ports,
            echo=True,
        )
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    except KeyboardInterrupt:
        print("[launch] interrupted: every worker was stopped", file=sys.stderr)
        return 130
    for worker in result.workers:
        how = "stopped by the launcher, " if worker.stopped else ""
        print(
            f"[launch] worker {worker.index} exited with code {worker.returncode} ({how}{worker.seconds:.1f} s)",
            file=sys.stderr,
        )
    if result.timed_out:
        print(f"[launch] timeout of {options.timeout:g} s expired", file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
