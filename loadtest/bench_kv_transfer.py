"""One request's KV handoff by shared memory and by NIXL, from the same prefill pool: JSON on stdout.

    python -m loadtest.bench_kv_transfer [--tokens 8192] [--repeats 5]

A child process exports a prefill pool of the embedded model's shape (SmolLM2-135M: 30 layers, 3 KV
heads of 64, float32 on the CPU) by shared memory and by NIXL at once (kv.transfer auto on a
tcp:// control plane); this process pulls the pages of one --tokens request into its own pool with
the decode's KvPuller, first through the shm handle, then through the NIXL one, --repeats times
each after a warm-up, and reports the median time, pages/s and GB/s of each. UCX runs on TCP over
the loopback device unless UCX_TLS / UCX_NET_DEVICES say otherwise.
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

from services.decode.handoff import KvPuller
from services.supervisor import REPO
from shared import wire
from shared.kv_pool import allocate_local_pool, make_layout, pages_for, shard_regions
from shared.messages import DecodeTask, SamplingParams, StopParams

UCX_DEFAULTS = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
SHAPE = dict(num_layers=30, page_size=16, num_kv_heads=3, head_dim=64, dtype=torch.float32)

_EXPORTER = textwrap.dedent("""
    import sys, torch
    from shared import wire
    from shared.kv_pool import make_layout
    from shared.kv_transfer import export_pool
    from shared.messages import PoolAvailable
    layout = make_layout(num_pages=int(sys.argv[1]), num_layers=30, page_size=16, num_kv_heads=3, head_dim=64,
                         dtype=torch.float32)
    exported = export_pool(layout, "bench", "cpu", "auto", cross_host=True)
    exported.pool.kv.copy_(torch.randn(exported.pool.kv.shape))
    print("handle", wire.encode(PoolAvailable("prefill-0", exported.handles)).hex(), flush=True)
    sys.stdin.read()
    exported.close()
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for name, value in UCX_DEFAULTS.items():
        os.environ.setdefault(name, value)
    pages = pages_for(args.tokens, SHAPE["page_size"])
    exporter = subprocess.Popen([sys.executable, "-c", _EXPORTER, str(pages)], cwd=REPO, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    try:
        handles = read_handles(exporter)
        local, _buffer = allocate_local_pool(make_layout(num_pages=pages + 1, **SHAPE), "cpu")
        report = {"tokens": args.tokens, "pages": pages, "shards": 2 * SHAPE["num_layers"],
                  "bytes": pages * sum(page_bytes for _, page_bytes in shard_regions(local.layout)),
                  "ucx": {name: os.environ[name] for name in UCX_DEFAULTS}}
        for transfer in ("shm", "nixl"):
            report[transfer] = measure(local, pages, handles, transfer, args.repeats, report["bytes"])
        print(json.dumps(report, indent=2))
    finally:
        exporter.stdin.close()
        exporter.wait(timeout=30)


def read_handles(exporter: subprocess.Popen) -> list:
    for line in exporter.stdout:
        if line.startswith("handle "):
            return wire.decode(bytes.fromhex(line.split()[1])).pool_handles
    raise RuntimeError("the exporting process ended without a handle")


def measure(local, pages: int, handles: list, transfer: str, repeats: int, nbytes: int) -> dict:
    puller = KvPuller(local, pages, lambda freed: None, transfer=transfer)
    puller.map_pool("prefill-0", handles)
    ids = wire.pack_page_ids(list(range(pages)))
    task = DecodeTask("bench", "prefill-0", ids, pages * SHAPE["page_size"], 0, SamplingParams(0, 1, 0, 0),
                      StopParams(1, True))
    times = []
    for _ in range(repeats + 1):  # the first warms up
        started = time.perf_counter()
        puller.pull(task, list(range(pages)))
        while not puller.landed():
            if puller.failed():
                raise RuntimeError(f"the {transfer} pull failed")
        times.append(time.perf_counter() - started)
    puller.close()
    median = statistics.median(times[1:])
    return {"median_s": round(median, 4), "min_s": round(min(times[1:]), 4), "pages_per_s": round(pages / median, 1),
            "gb_per_s": round(nbytes / median / 1e9, 3), "repeats": repeats}


if __name__ == "__main__":
    main()
