"""The daemon's control socket (HTTP/1.1 over DIR/control.sock).

`client` is the blocking client (the CLI, the runtime shim; the standard library's http.client):
importing it, or this package, never imports trio. `api` is the control API (a FastAPI app over
the node cache) and `server` serves it on the daemon's trio thread (hypercorn, after a peer
check). The client's names are here too: `fuse_client.control.request_json`, `.pin`, `.unpin`, `.DaemonNotRunning`, ...
"""

from __future__ import annotations

from .client import SOCKET_NAME, DaemonNotRunning, attach, detach, pin, request, request_json, socket_path, unpin

__all__ = ["SOCKET_NAME", "DaemonNotRunning", "attach", "detach", "pin", "request", "request_json", "socket_path",
           "unpin"]
