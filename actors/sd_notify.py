"""systemd's notify protocol without a dependency: one datagram per state change to the unix
socket named by $NOTIFY_SOCKET ("/path", or "@name" for the abstract namespace)."""
from __future__ import annotations

import os
import socket


def notify(state: str) -> bool:
    """Send e.g. "READY=1", "STATUS=loading", "WATCHDOG=1", "STOPPING=1". False when not
    running under systemd (no $NOTIFY_SOCKET) or the socket is gone."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
        return True
    except OSError:
        return False


def watchdog_period() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC), or None when systemd asked
    for none (or asked another process: $WATCHDOG_PID)."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 1e6 / 2
