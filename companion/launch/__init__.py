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

The package: ``supervisor.py`` (:func:`launch`), ``network.py`` (:func:`network_isolation`,
and the check before a launch) beside ``_netns.py`` (the namespaces themselves),
``workers.py`` (the cluster's addresses, ``TF_CONFIG`` and the results) and ``cli.py``
(``python -m companion.launch``).

Derived in the chapter *Training across machines* (``book/tools/training_across_machines``).
"""

from __future__ import annotations

from companion.launch.cli import main
from companion.launch.network import NetworkIsolation, NetworkIsolationError, network_isolation
from companion.launch.supervisor import RESTART_COUNT_VARIABLE, launch
from companion.launch.workers import LaunchResult, WorkerResult, cluster_spec, free_ports, tf_config

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
