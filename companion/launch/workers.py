"""What :mod:`companion.launch` returns (:class:`WorkerResult`, :class:`LaunchResult`) and
the cluster it describes (:func:`free_ports`, :func:`cluster_spec`, :func:`tf_config`).
Public through :mod:`companion.launch`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import socket
from typing import Mapping, Sequence

from companion._checks import check_int


#: Exit code of the command-line launcher when ``--timeout`` expired (as ``timeout(1)``).
TIMEOUT_EXIT_CODE = 124


def _check_count(name: str, value) -> int:
    return check_int(name, value, 1)


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkerResult:
    """How one worker process ended.

    Attributes:
        index: the worker's task index (``TF_CONFIG["task"]["index"]``); 0 is the chief.
        returncode: its exit code; negative if it was ended by a signal (``-9``: killed).
        output: everything it wrote to stdout and stderr, interleaved, without prefixes.
        seconds: time from the start of its attempt (of the group's start) until it exited.
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

    @property
    def signal(self) -> int | None:
        """The number of the signal that ended the worker, or ``None`` if it exited."""
        return -self.returncode if self.returncode < 0 else None

    @property
    def reason(self) -> str:
        """How it ended, in words, e.g. ``"exit code 3"`` or ``"killed by SIGKILL (signal 9)"``."""
        if self.signal is None:
            text = f"exit code {self.returncode}"
        else:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = "an unknown signal"
            text = f"killed by {name} (signal {self.signal})"
        return f"{text}, stopped by the launcher" if self.stopped else text


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """The outcome of :func:`launch`: its last attempt, and the attempts before it.

    Attributes:
        workers: one :class:`WorkerResult` per worker of this attempt, in task order.
        cluster: the cluster the workers were given (``{"worker": ["host:port", ...]}``).
        seconds: wall time from the start of the launch until the last worker of this
            attempt exited (for the result :func:`launch` returns: the whole launch).
        timed_out: whether the launch's ``timeout`` expired (the workers still running
            were then stopped).
        isolated: whether the workers ran in a private network namespace with only a
            loopback interface (see :func:`network_isolation`).
        network_namespace: that namespace as the kernel names it (``"net:[4026532178]"``,
            compare with ``os.readlink("/proc/self/ns/net")``); ``None`` if not isolated.
        failed_attempts: the earlier attempts of this launch, each a failed
            :class:`LaunchResult`, after which the whole group was restarted
            (``max_restarts``); empty if the first attempt is this one.
    """

    workers: tuple[WorkerResult, ...]
    cluster: dict[str, list[str]]
    seconds: float
    timed_out: bool = False
    isolated: bool = False
    network_namespace: str | None = None
    failed_attempts: tuple[LaunchResult, ...] = ()

    @property
    def returncodes(self) -> list[int]:
        """The exit code of every worker, in task order."""
        return [worker.returncode for worker in self.workers]

    @property
    def ok(self) -> bool:
        """Whether every worker exited with code 0 (and the timeout did not expire)."""
        return not self.timed_out and all(worker.ok for worker in self.workers)

    @property
    def restarts(self) -> int:
        """How many times the whole group was restarted."""
        return len(self.failed_attempts)

    @property
    def first_failure(self) -> WorkerResult | None:
        """The worker that failed first (by exit time), excluding workers the launcher stopped."""
        failed = [w for w in self.workers if not w.ok and not w.stopped] or [w for w in self.workers if not w.ok]
        return min(failed, key=lambda w: w.seconds) if failed else None

    @property
    def failure(self) -> str | None:
        """Who failed first and why, in words; ``None`` if :attr:`ok`.

        For example ``"worker 1 failed first: exit code 3 after 0.4 s"``.
        """
        if self.ok:
            return None
        first = self.first_failure
        if self.timed_out and (first is None or first.stopped):
            return "the timeout expired and the launcher stopped every worker still running"
        text = f"worker {first.index} failed first: {first.reason} after {first.seconds:.1f} s"
        return f"{text}, and then the timeout expired" if self.timed_out else text

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
        parts = [f"worker {w.index}: {w.reason} after {w.seconds:.1f} s" for w in self.workers]
        extras = [", timed out"] if self.timed_out else []
        if self.restarts:
            extras.append(f", {self.restarts} restart{'s' if self.restarts > 1 else ''}")
        extras.append(", isolated" if self.isolated else ", not isolated")
        return f"LaunchResult({'; '.join(parts)}{''.join(extras)})"


# --------------------------------------------------------------------------------------
# The cluster
# --------------------------------------------------------------------------------------


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports on ``host`` that are free right now.

    The operating system picks them (a bind to port 0); they are released before this
    function returns, so another program could take one in between: fine on a test
    machine, not a reservation. (In the private network of an isolated launch every port
    is free anyway.)

    Args:
        count: how many ports, >= 1.
        host: the interface to bind.

    Returns:
        The port numbers.

    Raises:
        ValueError: if ``count`` < 1.

    Example:
        >>> ports = free_ports(2)
        >>> len(set(ports)), all(0 < port < 65536 for port in ports)
        (2, True)
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

    The host is where the workers *connect* to each other. TensorFlow's server listens on
    every interface whatever host is named here: ``127.0.0.1`` does not make a worker
    unreachable from other machines (:func:`launch` isolates the workers' network instead).

    Args:
        workers: number of workers, >= 1.
        host: their address.
        ports: one port per worker; default: free ports (:func:`free_ports`).

    Returns:
        ``{"worker": ["host:port", ...]}``.

    Raises:
        ValueError: if ``workers`` < 1 or ``ports`` does not hold ``workers`` distinct
            ports in 1..65535.

    Example:
        >>> cluster_spec(2, ports=[23456, 23457])
        {'worker': ['127.0.0.1:23456', '127.0.0.1:23457']}
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

    Example:
        >>> config = tf_config({"worker": ["127.0.0.1:23456", "127.0.0.1:23457"]}, 1)
        >>> json.loads(config)["task"]
        {'type': 'worker', 'index': 1}
    """
    tasks = cluster.get(task_type)
    if not tasks:
        raise ValueError(f"cluster has no {task_type!r} job: {dict(cluster)}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(tasks):
        raise ValueError(f"index must be an int in 0..{len(tasks) - 1}, got {index!r}")
    config = {"cluster": {k: list(v) for k, v in cluster.items()}, "task": {"type": task_type, "index": index}}
    return json.dumps(config)
