"""CURVE on the router's ZeroMQ socket, when it listens on tcp://.

The default ipc:// socket needs none: it lies in the 0700 runtime folder, so the file system
already decides who may connect. A tcp:// port is open to whoever reaches it, and a peer that
registers as a worker would receive prompts and could answer with any tokens. So on tcp:// the
router is a CURVE server that admits only the public keys in its authorized folder (read at
start: restart the router to admit a new worker), and each worker a CURVE client that checks the
router's public key. Key files are zmq.auth certificates:
`python -c "import zmq.auth; zmq.auth.create_certificates('keys', 'router')"` writes
keys/router.key (public) and keys/router.key_secret (the key pair). shared/config.py checks the
files at load, so these functions only apply them.
"""

from __future__ import annotations

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from shared.config import RouterConfig, WorkerConfig


def needs_curve(endpoint: str) -> bool:
    return endpoint.startswith("tcp://")


def secure_server(socket: zmq.Socket, router: RouterConfig) -> AsyncioAuthenticator | None:
    """Makes the router's socket a CURVE server when its endpoint needs one; call before bind.

    Returns the running authenticator (stop it before the context terminates), or None.
    """
    if not needs_curve(router.zmq_endpoint()):
        return None
    public, secret = zmq.auth.load_certificate(router.zmq_secret_key_file)
    authenticator = AsyncioAuthenticator(socket.context)
    authenticator.start()
    authenticator.configure_curve(domain="*", location=router.zmq_authorized_keys_dir)
    socket.curve_publickey = public
    socket.curve_secretkey = secret
    socket.curve_server = True
    return authenticator


def secure_client(socket: zmq.Socket, endpoint: str, worker: WorkerConfig) -> None:
    """Makes a worker's socket a CURVE client of the router when the endpoint needs it; call before connect."""
    if not needs_curve(endpoint):
        return
    public, secret = zmq.auth.load_certificate(worker.zmq_secret_key_file)
    router_public, _ = zmq.auth.load_certificate(worker.zmq_router_public_key_file)
    socket.curve_publickey = public
    socket.curve_secretkey = secret
    socket.curve_serverkey = router_public
