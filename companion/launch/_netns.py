"""Private, loopback-only network namespaces for the workers of :mod:`companion.launch`.

A helper process makes a new unprivileged user namespace and a network namespace owned
by it, brings ``lo`` up and waits; the launcher opens both namespaces, and each worker
joins them before it starts the user's script. Public through :mod:`companion.launch`
(:class:`NetworkIsolation`, :class:`NetworkIsolationError`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import subprocess
import sys
import textwrap
from typing import Sequence

#: Seconds the process that creates a job's namespace may take to answer.
_NAMESPACE_SECONDS = 20.0
#: Width of the lines of :class:`NetworkIsolationError`'s message (a notebook's width).
_WIDTH = 76
#: Set to ``1`` to make this machine behave as one without network namespaces (as
#: Colab may be): :func:`companion.launch.network_isolation` reports them unavailable and
#: :func:`companion.launch.launch` refuses without ``allow_network_exposure=True``. For
#: trying a script's or a notebook's path on such a machine; it never exposes anything.
SIMULATE_UNAVAILABLE_VARIABLE = "COMPANION_NO_NETWORK_NAMESPACES"


class NetworkIsolationError(RuntimeError):
    """:func:`launch` cannot isolate the workers' network and was not allowed to expose it.

    The message is short and says the one-line choice: where the reader trusts the
    network (or its ports are firewalled), ``allow_network_exposure=True``.

    Attributes:
        reason: why no private network could be made on this machine.

    Example:
        >>> error = NetworkIsolationError("no user namespaces")
        >>> print(str(error).splitlines()[0])
        No private network for the workers here: no user namespaces.
        >>> "allow_network_exposure=True" in str(error)
        True
    """

    def __init__(self, reason: str):
        self.reason = reason
        first = textwrap.fill(f"No private network for the workers here: {reason}.", _WIDTH)
        super().__init__(
            f"{first}\n"
            + textwrap.fill(
                "Without one, their TensorFlow servers listen on every interface of "
                "this machine, without authentication, and run any graph they are sent "
                "(TensorFlow's SECURITY.md). On a network you trust, or with their "
                "ports firewalled, allow that with one argument:",
                _WIDTH,
            )
            + "\n    launch(..., allow_network_exposure=True)"
            + "\n    python -m companion.launch --allow-network-exposure ..."
        )


@dataclasses.dataclass(frozen=True)
class NetworkIsolation:
    """Whether :func:`launch` can run workers in a private network on this machine.

    Attributes:
        available: ``True`` if a network namespace with only a loopback interface could
            be made (and was removed again).
        reason: how (``"a new user and network namespace with only 'lo'"``), or why not.
    """

    available: bool
    reason: str

    def __bool__(self) -> bool:
        return self.available


class _Unavailable(Exception):
    """No private network namespace can be made here; the message says why."""


# The process that makes a job's namespaces. It runs as ``python -I -S -c _MAKE_NAMESPACE``
# (no site-packages: it starts in milliseconds), single-threaded as unshare(2) requires
# for a user namespace: it makes a user namespace (in which it may configure the network
# without privileges) and a network namespace owned by it, maps its own user and group id
# to themselves (as ``unshare --map-current-user``), brings the loopback interface up,
# answers "ok <namespaces> <net namespace>" and waits until the launcher has opened its
# namespaces (it closes our stdin). Without user namespaces a privileged caller still gets
# a network namespace alone.
_MAKE_NAMESPACE = r"""
import ctypes, fcntl, os, socket, struct, sys
NEWUSER, NEWNET = 0x10000000, 0x40000000
libc = ctypes.CDLL(None, use_errno=True)
def answer(text):
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
def fail(text):
    answer("error " + text)
    sys.exit(1)
uid, gid = os.getuid(), os.getgid()
kinds = "user,net"
if libc.unshare(NEWUSER | NEWNET) != 0:
    first = os.strerror(ctypes.get_errno())
    if libc.unshare(NEWNET) != 0:
        fail("the kernel refused a new user and network namespace (%s) and a network "
             "namespace alone (%s)" % (first, os.strerror(ctypes.get_errno())))
    kinds = "net"
else:
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)),
                           ("gid_map", "%d %d 1" % (gid, gid))):
            with open("/proc/self/" + name, "w") as file:
                file.write(text)
    except OSError as error:
        fail("cannot map the user id into a new user namespace (%s)" % error)
try:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock.fileno(), 0x8913, request))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(sock.fileno(), 0x8914, struct.pack("16sh", b"lo", flags | 1))  # SIOCSIFFLAGS IFF_UP
except OSError as error:
    fail("cannot bring up the loopback interface of a new network namespace (%s)" % error)
answer("ok %s %s" % (kinds, os.readlink("/proc/self/ns/net")))
sys.stdin.read()
"""

# What starts a worker in the job's namespaces: ``python -I -S -c _ENTER_NAMESPACE
# <fd,kind>... -- command...`` joins each namespace whose file descriptor it inherited
# (setns(2)), checks that it is in the job's network namespace, and becomes the worker
# (execv): the worker's process id is this one's.
_ENTER_NAMESPACE = r"""
import ctypes, os, sys
FLAGS = {"user": 0x10000000, "net": 0x40000000}
libc = ctypes.CDLL(None, use_errno=True)
separator = sys.argv.index("--")
expected, entries, command = sys.argv[1], sys.argv[2:separator], sys.argv[separator + 1:]
for entry in entries:
    fd, kind = entry.split(",")
    if libc.setns(int(fd), FLAGS[kind]) != 0:
        sys.stderr.write("companion.launch: cannot enter the job's %s namespace: %s\n"
                         % (kind, os.strerror(ctypes.get_errno())))
        os._exit(125)
    os.close(int(fd))
if os.readlink("/proc/self/ns/net") != expected:
    sys.stderr.write("companion.launch: not in the job's network namespace %s\n" % expected)
    os._exit(125)
os.execvp(command[0], command)
"""


class _Namespace:
    """A private user + network namespace with only ``lo``, held open by file descriptors."""

    def __init__(self) -> None:
        if os.environ.get(SIMULATE_UNAVAILABLE_VARIABLE, "") not in ("", "0"):
            raise _Unavailable(f"{SIMULATE_UNAVAILABLE_VARIABLE} is set, so network namespaces count as unavailable")
        if not sys.platform.startswith("linux"):
            raise _Unavailable(f"network namespaces are a Linux feature, and this is {sys.platform}")
        maker = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _MAKE_NAMESPACE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.fds: dict[str, int] = {}
        try:
            ready, _, _ = select.select([maker.stdout], [], [], _NAMESPACE_SECONDS)
            answer = maker.stdout.readline().split() if ready else []
            if answer[:1] != ["ok"]:
                if not ready:
                    raise _Unavailable(f"making a network namespace took more than {_NAMESPACE_SECONDS:g} s")
                if answer[:1] == ["error"]:
                    raise _Unavailable(" ".join(answer[1:]))
                maker.kill()
                raise _Unavailable(f"making a network namespace failed: {maker.stderr.read().strip()[-500:]!r}")
            kinds, self.name = answer[1].split(","), answer[2]
            try:
                for kind in kinds:
                    self.fds[kind] = os.open(f"/proc/{maker.pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
                same = os.readlink(f"/proc/{maker.pid}/ns/net") == self.name  # the maker is still the one
            except OSError as error:
                raise _Unavailable(f"cannot open the new namespaces ({error})") from None
            if not same:
                raise _Unavailable("the process that made the network namespace vanished")
        except BaseException:
            self.close()
            raise
        finally:
            with contextlib.suppress(OSError):
                maker.stdin.close()
            try:
                maker.wait(timeout=5)
            except subprocess.TimeoutExpired:
                maker.kill()
                maker.wait()
            maker.stdout.close()
            maker.stderr.close()

    @property
    def description(self) -> str:
        what = "a new user and network namespace" if "user" in self.fds else "a new network namespace"
        return f"{what} with only 'lo'"

    def command(self, command: Sequence[str]) -> tuple[list[str], tuple[int, ...]]:
        """The command that runs ``command`` in this namespace, and the descriptors to pass."""
        order = [kind for kind in ("user", "net") if kind in self.fds]  # user first: it owns net
        entries = [f"{self.fds[kind]},{kind}" for kind in order]
        return [sys.executable, "-I", "-S", "-c", _ENTER_NAMESPACE, self.name, *entries, "--", *command], tuple(
            self.fds[kind] for kind in order
        )

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = {}
