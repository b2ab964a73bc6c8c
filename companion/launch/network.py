"""Whether the workers can run in a network of their own, and the check before a launch.

:func:`network_isolation` tries to make a private, loopback-only network namespace (and
removes it); :func:`launch <companion.launch.launch>` makes one per group of workers with
:func:`_create_namespace`, or, where none can be made, refuses or (with
``allow_network_exposure=True``) warns once (:func:`_warn_exposure`). The namespaces
themselves (the helper process, joining them) are in :mod:`companion.launch._netns`.
"""

from __future__ import annotations

import ipaddress
import warnings

from companion.launch._netns import NetworkIsolation, NetworkIsolationError, _Namespace, _Unavailable

__all__ = ["NetworkIsolation", "NetworkIsolationError", "network_isolation"]

# --------------------------------------------------------------------------------------
# Network isolation
# --------------------------------------------------------------------------------------




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
