"""A service's config at start: loaded (shared/config/loading.py), then checked against what the
service itself will read: the CURVE certificates, TLS and token files, the runtime folder.

shared/config/schema.py checks values; this module checks the files they name, because only the
service that reads a file knows whether it needs it (the router needs its secret key, a worker the
router's public key). A bad file stops the service at start with a one-line reason, exit 2.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from pathlib import Path

import zmq
import zmq.auth

from shared.config.loading import add_config_arguments, load_config

from shared.config.schema import Config, ConfigError, RouterConfig
from shared.control.curve import KeyPolicy, needs_curve
from shared.runtime.runtime_dir import UnsafePath, prepare_runtime_dir


def parse_service_config(service: str) -> Config:
    """A service's config from its command line, or exit 2 with a one-line reason."""
    parser = argparse.ArgumentParser(prog=f"python -m services.{service}")
    add_config_arguments(parser)
    try:
        config = load_config(parser.parse_args())
        check_service(config, service)
        prepare_runtime_dir(config.router.runtime_dir)
        return config
    except (ConfigError, UnsafePath) as exc:
        parser.error(str(exc))


def check_service(config: Config, service: str) -> None:
    """The settings and files that service reads: a bad one stops it at start."""
    _check_colocated(config, service)
    endpoint = config.router.zmq_endpoint()
    curve = needs_curve(endpoint)
    if curve and not zmq.has("curve"):
        raise ConfigError(f"router.zmq_address {endpoint} needs CURVE, which this libzmq lacks")
    if service in ("router", "stack"):
        _check_network_exposure(config.router)
    if service == "router":
        if curve:
            _check_router_keys(config)
        _check_router_files(config)
    elif curve:
        worker = config.worker
        _require_keys("a worker", endpoint, "worker", worker, ("zmq_secret_key_file", "zmq_router_public_key_file"))
        _check_certificate("worker.zmq_secret_key_file", worker.zmq_secret_key_file, secret=True)
        _check_certificate("worker.zmq_router_public_key_file", worker.zmq_router_public_key_file, secret=False)


def _check_colocated(config: Config, service: str) -> None:
    if service != "colocated":
        return
    if config.prefill.tensor_parallel > 1 or config.decode.tensor_parallel > 1:
        raise ConfigError("services.colocated runs one model in one process: tensor_parallel must be 1; "
                          "serve tensor-parallel workers as separate prefill and decode services")
    if config.decode.weights_from:
        raise ConfigError("decode.weights_from does not apply to services.colocated: its prefill and "
                          "decode share one model already")
    if config.kv.transfer == "nixl":
        raise ConfigError("kv.transfer nixl does not apply to services.colocated: its decode copies the "
                          "prefill's pages within the process; use auto")
    if config.decode.idle_spin_s:
        raise ConfigError("decode.idle_spin_s must be 0 in services.colocated: a spinning decode thread "
                          "would hold the GIL its prefill thread needs")


def is_loopback(address: str) -> bool:
    """Whether a "host:port" (or gRPC's "unix:path") serves this host alone; a name other than
    localhost, or an empty host (every interface), counts as the network."""
    if address.startswith("unix:"):
        return True
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_network_exposure(router: RouterConfig) -> None:
    exposed = [f"router.{name} {getattr(router, name)}" for name in ("grpc_address", "http_address")
               if getattr(router, name) and not is_loopback(getattr(router, name))]
    missing = [what for what, present in (("TLS (router.tls_cert_file)", router.tls_cert_file),
                                          ("a bearer token (router.auth_token_file)", router.auth_token_file
                                           or router.auth_token)) if not present]
    if exposed and missing and not router.allow_insecure_network:
        raise ConfigError(f"{' and '.join(exposed)}: serving beyond this host without {' and '.join(missing)} "
                          "lets anyone who reaches it in; set them, serve on 127.0.0.1, or set "
                          "router.allow_insecure_network = true to serve so anyway (README.md, Security)")


def _check_router_keys(config: Config) -> None:
    router = config.router
    _require_keys("the router", router.zmq_endpoint(), "router", router,
                  ("zmq_secret_key_file", "zmq_authorized_keys_dir"))
    _check_certificate("router.zmq_secret_key_file", router.zmq_secret_key_file, secret=True)
    if not list(Path(router.zmq_authorized_keys_dir).glob("*.key")):
        raise ConfigError(f"router.zmq_authorized_keys_dir: {router.zmq_authorized_keys_dir} holds no "
                          "public-key certificate (*.key): no worker could connect")
    try:
        KeyPolicy.from_folder(router.zmq_authorized_keys_dir)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"router.zmq_authorized_keys_dir: {exc}") from None


def _check_router_files(config: Config) -> None:
    router = config.router
    for name in ("tls_cert_file", "tls_key_file", "auth_token_file", "admin_token_file"):
        path = getattr(router, name)
        if path and not (Path(path).is_file() and os.access(path, os.R_OK)):
            raise ConfigError(f"router.{name}: cannot read the file {path}")
    if (router.auth_token_file or router.auth_token) and not router.bearer_tokens():
        source = "auth_token_file" if router.auth_token_file else "auth_token"
        raise ConfigError(f"router.{source}: the token is empty")
    if router.admin_token_file and not router.admin_token():
        raise ConfigError("router.admin_token_file: the token is empty")
    if router.admin_token_file and router.admin_token() in router.bearer_tokens():
        raise ConfigError("router.admin_token_file holds the generation token (router.auth_token_file or "
                          "auth_token): give admin calls a token of their own")


def _require_keys(who: str, endpoint: str, section: str, values: object, fields: tuple[str, ...]) -> None:
    missing = [f"{section}.{name}" for name in fields if not getattr(values, name)]
    if missing:
        raise ConfigError(f"router.zmq_address {endpoint} is open to the network, so {who} needs CURVE keys: "
                          f"set {' and '.join(missing)} (README.md, Security)")


def _check_certificate(name: str, path: str, secret: bool) -> None:
    try:
        _, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{name}: {exc}") from None
    if secret and secret_key is None:
        raise ConfigError(f"{name}: {path} holds only a public key; give the secret-key certificate (.key_secret)")
