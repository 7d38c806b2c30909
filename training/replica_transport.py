"""torchft's HTTP checkpoint transport, bound to one address and unpickling with weights_only=True.

torchft 0.2.0's HTTPTransport (the default transport of its Manager) serves a replica group's state on all
interfaces ("", port 0), advertises `socket.gethostname()`, and reads what it receives with
`torch.load(weights_only=False)`: whatever a peer (or anyone who can answer in its place) sends is unpickled with
full pickle, able to run code before any digest could be checked. This subclass serves on `host` only, advertises
`host`, and reads with the weights-only unpickler (tensors, containers, numbers, strings: what a trainer's state
holds). Imported by training/replica.py only when fault_tolerance.mode is replica_groups (torchft is optional).
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
import threading
import urllib.request
from datetime import timedelta
from http.server import ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)


def _server_class(host: str) -> type[ThreadingHTTPServer]:
    """An HTTP server class of the address family of `host` (an IPv4 or IPv6 address, or a host name)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a host name: the family of its first address
        family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    return type("BoundHTTPServer", (ThreadingHTTPServer,), {"address_family": family, "request_queue_size": 1024})


@functools.cache
def bound_transport_class() -> type[Any]:
    """The transport class (built on first use: torchft is optional and imported here, in the mode only)."""
    from torchft.checkpointing._serialization import _streaming_load  # noqa: PLC0415 - optional dependency
    from torchft.checkpointing.http_transport import HTTPTransport  # noqa: PLC0415 - optional dependency

    class BoundHTTPTransport(HTTPTransport):
        """HTTPTransport that listens on `host` only and loads received states weights-only."""

        def __init__(self, timeout: timedelta, host: str) -> None:
            self._host = host  # address() is called inside torchft's __init__
            super().__init__(timeout=timeout, num_chunks=0)
            # torchft binds its server inside __init__ on every interface: replace it before any state is served
            # (send_checkpoint has not been called, so it serves nothing yet).
            handler = self._server.RequestHandlerClass
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = _server_class(host)((host, 0), handler)
            self._thread = threading.Thread(target=self._serve, daemon=True, name="replica-checkpoint-server")
            self._thread.start()
            log.info("replica checkpoint server on %s", self.address())

        def address(self) -> str:
            """The URL peers fetch this group's state from (the step and key are appended)."""
            port = self._server.socket.getsockname()[1]
            host = f"[{self._host}]" if ":" in self._host else self._host
            return f"http://{host}:{port}/checkpoint/"

        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> Any:
            """Fetch a peer's state and unpickle it with the weights-only unpickler."""
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:  # noqa: S310 - a peer's http URL
                return _streaming_load(f, weights_only=True)

    return BoundHTTPTransport
