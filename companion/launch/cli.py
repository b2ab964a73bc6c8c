"""The command line: ``python -m companion.launch --workers N script.py [args...]``."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Sequence

from companion.launch.network import NetworkIsolationError, network_isolation
from companion.launch.supervisor import launch

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

