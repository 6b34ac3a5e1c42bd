"""One request's KV handoff by the host's own transfer and by NIXL, from the same prefill pool: JSON on stdout.

    python -m loadtest.engine.bench_kv_transfer [--tokens 8192] [--repeats 5]        # CPU: shm vs NIXL
    python -m loadtest.engine.bench_kv_transfer --device cuda:0 --shape 8b --tokens 1024,8192,32768
                                                                        # GPU: cuda_ipc vs NIXL

A child process exports a prefill pool on --device by the host's kind and by NIXL at once
(kv.transfer auto on a tcp:// control plane); this process pulls the pages of one request of each
--tokens into its own pool on the same device with the decode's KvPuller, through each handle,
--repeats times after a warm-up, and reports the median time, pages/s and GB/s of each, beside
the copy floor: one contiguous copy of the same bytes within this process. Shapes: "embedded"
(SmolLM2-135M: 30 layers, 3 KV heads of 64, float32) and "8b" (Llama-3.1-8B: 32 layers, 8 KV
heads of 128, bfloat16). UCX runs on TCP over the loopback device unless UCX_TLS /
UCX_NET_DEVICES say otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time

import torch

from services.decode.kv_pull import KvPuller
from services.stack.supervisor import REPO
from shared.control import wire
from shared.control.messages import DecodeTask, SamplingParams, StopParams
from shared.kv.pages import pages_for
from shared.kv.pool import allocate_local_pool, make_layout, shard_regions
from shared.kv.transfer.choice import HOST_KIND

UCX_DEFAULTS = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
SHAPES = {"embedded": dict(num_layers=30, page_size=16, num_kv_heads=3, head_dim=64, dtype="float32"),
          "8b": dict(num_layers=32, page_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")}

_EXPORTER = textwrap.dedent("""
    import json, sys, torch
    from shared.control import wire
    from shared.kv.pool import make_layout
    from shared.kv.transfer import export_pool
    from shared.control.messages import PoolAvailable
    shape, pages, device = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    layout = make_layout(num_pages=pages, **{**shape, "dtype": getattr(torch, shape["dtype"])})
    exported = export_pool(layout, "bench", device, "auto", cross_host=True)
    exported.pool.kv.view(torch.uint8).random_()
    print("handle", wire.encode(PoolAvailable("prefill-0", exported.handles)).hex(), flush=True)
    sys.stdin.read()
    exported.close()
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192", help="comma-separated request lengths")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="embedded")
    args = parser.parse_args()
    for name, value in UCX_DEFAULTS.items():
        os.environ.setdefault(name, value)
    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    lengths = [int(t) for t in args.tokens.split(",")]
    pages = pages_for(max(lengths), shape["page_size"])
    exporter = subprocess.Popen([sys.executable, "-c", _EXPORTER, json.dumps(shape), str(pages), args.device],
                                cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        handles = read_handles(exporter)
        layout = make_layout(num_pages=pages + 1, **{**shape, "dtype": getattr(torch, shape["dtype"])})
        local, _buffer = allocate_local_pool(layout, device)
        page_bytes = sum(size for _, size in shard_regions(local.layout))
        report = {"device": str(device), "shape": args.shape, "page_bytes": page_bytes, "repeats": args.repeats,
                  "ucx": {name: os.environ[name] for name in UCX_DEFAULTS}, "requests": []}
        for tokens in lengths:
            count = pages_for(tokens, shape["page_size"])
            row = {"tokens": tokens, "pages": count, "bytes": count * page_bytes,
                   "copy_floor": copy_floor(count * page_bytes, device, args.repeats)}
            for transfer in (HOST_KIND[device.type], "nixl"):
                row[transfer] = measure(local, count, handles, transfer, args.repeats, count * page_bytes)
            report["requests"].append(row)
        print(json.dumps(report, indent=2))
    finally:
        exporter.stdin.close()
        exporter.wait(timeout=60)


def read_handles(exporter: subprocess.Popen) -> list:
    for line in exporter.stdout:
        if line.startswith("handle "):
            return wire.decode(bytes.fromhex(line.split()[1])).pool_handles
    raise RuntimeError("the exporting process ended without a handle")


def summary(times: list[float], nbytes: int, pages: int | None = None) -> dict:
    median = statistics.median(times)
    rates = {"pages_per_s": round(pages / median, 1)} if pages else {}
    return {"median_s": round(median, 6), "min_s": round(min(times), 6), **rates, "gb_per_s": round(nbytes / median / 1e9, 3)}


def copy_floor(nbytes: int, device: torch.device, repeats: int) -> dict:
    """One contiguous copy of the request's bytes within this process: what no transfer beats."""
    src, dst = torch.empty(nbytes, dtype=torch.uint8, device=device), torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return summary(times[1:], nbytes)


def measure(local, pages: int, handles: list, transfer: str, repeats: int, nbytes: int) -> dict:
    puller = KvPuller(local, local.layout.num_pages - 1, lambda freed: None, transfer=transfer)
    puller.map_pool("prefill-0", handles)
    task = DecodeTask("bench", "prefill-0", wire.pack_page_ids(list(range(pages))), pages * local.layout.page_size, 0,
                      SamplingParams(0, 1, 0, 0), StopParams(1, True))
    times = []
    for _ in range(repeats + 1):  # the first warms up
        started = time.perf_counter()
        puller.pull(task, list(range(pages)))
        while not puller.landed():
            if puller.failed():
                raise RuntimeError(f"the {transfer} pull failed")
        times.append(time.perf_counter() - started)
    puller.close()
    return summary(times[1:], nbytes, pages)


if __name__ == "__main__":
    main()
