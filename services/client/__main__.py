"""pdserve: a command-line client. `pdserve generate "Hello"` prints the answer as it streams."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc
from pdserve.v1 import generation_pb2, generation_pb2_grpc
from shared.config.loading import env_name
from shared.config.schema import default_runtime_dir
from shared.runtime.admin_token import local_admin_token_path


def _generate(channel, args) -> int:
    stub = generation_pb2_grpc.GenerationStub(channel)
    request = generation_pb2.GenerateRequest(max_tokens=args.max_tokens, temperature=args.temperature,
                                             stop=args.stop, ignore_eos=args.ignore_eos)
    if args.raw:
        request.prompt = args.text
    else:
        request.messages.add(role="user", content=args.text)
    if args.seed is not None:
        request.seed = args.seed
    try:
        for chunk in stub.Generate(request, timeout=args.timeout, metadata=args.metadata):
            print(chunk.text, end="", flush=True)
            if chunk.finish_reason:
                print(f"\n[{chunk.finish_reason}: {chunk.usage.prompt_tokens} prompt tokens, "
                      f"{chunk.usage.completion_tokens} generated]", file=sys.stderr)
    except grpc.RpcError as exc:
        print(f"\npdserve: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0


def _workers(channel, args) -> int:
    stub = generation_pb2_grpc.GenerationStub(channel)
    workers = stub.ListWorkers(generation_pb2.ListWorkersRequest(), timeout=args.timeout, metadata=args.metadata)
    for w in workers.workers:
        print(f"{w.worker_id:12} {w.role:8} pages free {w.free_pages}/{w.total_pages} reserved {w.reserved_pages} "
              f"running {w.running_requests} waiting {w.waiting_requests} pending prompt tokens "
              f"{w.pending_prompt_tokens}{' draining' if w.draining else ''}")
    return 0


def _admin_token(path: str | None) -> str:
    """The token of --admin-token-file, else of the runtime folder's admin-token that `make run`
    writes, else none (the router's refusal then says how to configure one)."""
    if path:
        return Path(path).read_text().strip()
    default = local_admin_token_path(os.environ.get(env_name("router", "runtime_dir")) or default_runtime_dir())
    return default.read_text().strip() if default.is_file() else ""


def _drain(channel, args) -> int:
    stub = generation_pb2_grpc.AdminStub(channel)
    try:
        stub.Drain(generation_pb2.DrainRequest(worker_id=args.worker_id), timeout=args.timeout,
                   metadata=args.admin_metadata)
    except grpc.RpcError as exc:
        print(f"pdserve: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(f"{args.worker_id} is draining: it finishes what it holds, then exits")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--tls-ca", metavar="FILE", help="connect over TLS, trusting this PEM CA certificate")
    parser.add_argument("--token-file", metavar="FILE", help="send the bearer token this file holds")
    parser.add_argument("--admin-token-file", metavar="FILE",
                        help="on admin calls (drain), send the token this file holds; default: admin-token in the "
                             "runtime folder (PDSERVE_ROUTER_RUNTIME_DIR, else the default), which `make run` writes")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="stream an answer to a chat message")
    generate.add_argument("text")
    generate.add_argument("--raw", action="store_true", help="send as a plain prompt, no chat template")
    generate.add_argument("--max-tokens", type=int, default=256)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", default=[])
    generate.add_argument("--ignore-eos", action="store_true")
    commands.add_parser("workers", help="list the registered workers and their KV pools")
    drain = commands.add_parser("drain", help="make a worker take no new work, finish what it holds and exit")
    drain.add_argument("worker_id")
    args = parser.parse_args()
    try:
        ca = Path(args.tls_ca).read_bytes() if args.tls_ca else None
        token = Path(args.token_file).read_text().strip() if args.token_file else ""
        admin = _admin_token(args.admin_token_file) if args.command == "drain" else ""
    except OSError as exc:
        parser.error(str(exc))
    args.metadata = [("authorization", f"Bearer {token}")] if token else []
    args.admin_metadata = [("authorization", f"Bearer {admin}")] if admin else []
    channel = grpc.secure_channel(args.address, grpc.ssl_channel_credentials(ca)) if ca else \
        grpc.insecure_channel(args.address)
    with channel:
        return {"generate": _generate, "workers": _workers, "drain": _drain}[args.command](channel, args)


if __name__ == "__main__":
    sys.exit(main())
