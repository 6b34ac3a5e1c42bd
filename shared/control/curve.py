"""CURVE on the router's ZeroMQ socket, when it listens on tcp://.

The default ipc:// socket needs none: it lies in the 0700 runtime folder, so the file system
already decides who may connect. A tcp:// port is open to whoever reaches it, and a peer that
registers as a worker would receive prompts and could answer with any tokens. So on tcp:// the
router is a CURVE server that admits only the public keys in its authorized folder (read at
start: restart the router to admit a new worker), and each worker a CURVE client that checks the
router's public key.

An admitted key is not a licence to be any worker: each certificate in the authorized folder says,
in its metadata, the role and the worker ids its holder may register as, so a stolen decode key
cannot take over prefill-0. The router's authenticator names each connection by its certificate's
file name (the ZAP User-Id, which ZeroMQ attaches to every frame from it), and the router asks
KeyPolicy.permits at Register.

Key files are zmq.auth certificates (README.md, Security, shows how to make them):

    metadata
        role = decode
        worker_ids = decode-*
    curve
        public-key = "..."

shared/runtime/service_config.py checks the files at start, so these functions only apply them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

from shared.config.schema import RouterConfig, WorkerConfig
from shared.control.messages import Role

METADATA_HELP = ("add `role = prefill` (or decode) and `worker_ids = <ids, comma-separated, globs allowed, "
                 "e.g. decode-*>` under its `metadata` line (README.md, Security)")


def needs_curve(endpoint: str) -> bool:
    return endpoint.startswith("tcp://")


@dataclass(frozen=True)
class Grant:
    """What the holder of one authorized key may register as."""
    public_key: bytes             # z85, as the authenticator sees it
    role: Role
    worker_ids: tuple[str, ...]   # fnmatch patterns


@dataclass(frozen=True)
class KeyPolicy:
    """The grants of the authorized folder, by User-Id: the certificate's file name."""
    grants: Mapping[str, Grant]

    @classmethod
    def from_folder(cls, folder: str | Path) -> KeyPolicy:
        """Every *.key certificate in folder (the files zmq.auth admits); ValueError names a bad one."""
        grants: dict[str, Grant] = {}
        for path in sorted(Path(folder).glob("*.key")):
            grant = _read_grant(path)
            twin = next((name for name, g in grants.items() if g.public_key == grant.public_key), None)
            if twin is not None:
                raise ValueError(f"{path} and {twin} hold the same public key: keep one")
            grants[path.name] = grant
        return cls(grants)

    def permits(self, user_id: str | None, worker_id: str, role: Role) -> bool:
        grant = self.grants.get(user_id) if user_id is not None else None
        return grant is not None and grant.role == role and any(fnmatchcase(worker_id, p) for p in grant.worker_ids)


def _read_grant(path: Path) -> Grant:
    public_key, _ = zmq.auth.load_certificate(path)
    metadata = _read_metadata(path)
    role, worker_ids = metadata.get("role", ""), metadata.get("worker_ids", "")
    if not role or not worker_ids:
        raise ValueError(f"{path} does not say which worker it admits: {METADATA_HELP}")
    if role not in {r.value for r in Role}:
        raise ValueError(f"{path}: role {role!r} must be prefill or decode")
    patterns = tuple(p.strip() for p in worker_ids.split(",") if p.strip())
    if not patterns:
        raise ValueError(f"{path}: worker_ids names no worker: {METADATA_HELP}")
    return Grant(public_key, Role(role), patterns)


def _read_metadata(path: Path) -> dict[str, str]:
    """The `metadata` section of a zmq.auth certificate, which load_certificate skips: a heading
    at the line's start, then indented `name = value` lines, values optionally quoted."""
    section, metadata = "", {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():
            section = line.strip()
        elif section == "metadata":
            name, _, value = line.partition("=")
            metadata[name.strip()] = value.strip().strip("\"'")
    return metadata


class KeyAuthenticator(AsyncioAuthenticator):
    """Admits the policy's keys and names each connection by its certificate (its ZAP User-Id)."""

    def __init__(self, context: zmq.Context, policy: KeyPolicy):
        super().__init__(context)
        self._user_ids = {grant.public_key: user_id for user_id, grant in policy.grants.items()}
        self.configure_curve_callback(domain="*", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """zmq.auth's credentials-provider hook, with the client's z85 key."""
        return key in self._user_ids

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._user_ids[z85.encode(client_public_key)]


@dataclass
class CurveServer:
    """The running authenticator and the policy that goes with it."""
    authenticator: KeyAuthenticator
    policy: KeyPolicy

    def permits(self, user_id: str | None, worker_id: str, role: Role) -> bool:
        return self.policy.permits(user_id, worker_id, role)

    def stop(self) -> None:
        """Before the context terminates."""
        self.authenticator.stop()


def secure_server(socket: zmq.Socket, router: RouterConfig) -> CurveServer | None:
    """Makes the router's socket a CURVE server when its endpoint needs one; call before bind.

    None on ipc://: no keys, so no User-Id on the frames, and every Register is permitted (the
    runtime folder's mode already decided who could connect).
    """
    if not needs_curve(router.zmq_endpoint()):
        return None
    public, secret = zmq.auth.load_certificate(router.zmq_secret_key_file)
    policy = KeyPolicy.from_folder(router.zmq_authorized_keys_dir)
    authenticator = KeyAuthenticator(socket.context, policy)
    authenticator.start()
    socket.curve_publickey = public
    socket.curve_secretkey = secret
    socket.curve_server = True
    return CurveServer(authenticator, policy)


def secure_client(socket: zmq.Socket, endpoint: str, worker: WorkerConfig) -> None:
    """Makes a worker's socket a CURVE client of the router when the endpoint needs it; call before connect."""
    if not needs_curve(endpoint):
        return
    public, secret = zmq.auth.load_certificate(worker.zmq_secret_key_file)
    router_public, _ = zmq.auth.load_certificate(worker.zmq_router_public_key_file)
    socket.curve_publickey = public
    socket.curve_secretkey = secret
    socket.curve_serverkey = router_public
