"""A TCP port for a rank's rendezvous that nothing else can take between choosing it and binding it.

Picking a free port by binding port 0, closing the socket and handing the number to a rank that
binds it seconds later races: anything on the machine may be given the port in between, and the
rank fails with ``EADDRINUSE``. A ``HeldPort`` keeps its socket bound (with ``SO_REUSEADDR``, never
listening) while it lives. On Linux a port bound that way is not handed out for port-0 binds or
outgoing connections, and a plain bind of it fails, but a server that sets ``SO_REUSEADDR`` itself
can bind and listen on it, which torch.distributed's ``TCPStore`` (rank 0's rendezvous) does. So:
hold the port, start the ranks with its number, and close it once they are done (or once rank 0
has started listening). Stdlib only.
"""

from __future__ import annotations

import socket
from types import TracebackType


class HeldPort:
    """A TCP port reserved on ``host`` (all interfaces when empty) until ``close()``."""

    def __init__(self, host: str = "") -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self.port: int = self._socket.getsockname()[1]

    def close(self) -> None:
        self._socket.close()

    def __enter__(self) -> HeldPort:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
