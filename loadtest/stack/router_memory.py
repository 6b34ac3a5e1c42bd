"""The router's resident memory under `make run`'s launcher, after it has served chats and prompts
over both fronts, against the 150 MB budget and against what torch alone costs an interpreter (what
the router carried when it imported it), both measured in this run.

    python -m loadtest.stack.router_memory [--requests 20] [--out docs/results/router_memory.json]

Prints one JSON object; exits 1 when the router is over budget or has torch or triton mapped.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from openai import OpenAI

from loadtest.lib.report import emit
from loadtest.lib.stack_settings import MODEL_CACHE_DIR
from pdserve.v1 import generation_pb2
from services.stack.local import LocalStack

BUDGET_MB = 150.0  # issue 20: the router, which never touches a GPU, stays under it


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text()
        found += [int(child) for child in text.split()]
    return found


def router_pid(launcher_pid: int) -> int:
    for pid in children(launcher_pid):
        if b"services.router" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise RuntimeError("the launcher has no router child")


def memory_mb(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (the peak) in MB, from /proc/<pid>/status (which counts in KiB)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {name: int(fields[key].split()[0]) * 1024 / 1e6 for name, key in (("rss_mb", "VmRSS"), ("peak_mb", "VmHWM"))}


def gpu_libraries_mapped(pid: int) -> list[str]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return sorted({line.rsplit("/", 1)[-1] for line in maps.splitlines() if "libtorch" in line or "triton" in line})


def torch_interpreter_mb() -> float:
    """What `import torch, transformers` alone makes an interpreter resident: the router's old cost."""
    script = ("import torch, transformers, pathlib; "
              "print([l for l in pathlib.Path('/proc/self/status').read_text().splitlines() if l.startswith('VmRSS')][0])")
    line = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    return int(line.split()[1]) * 1024 / 1e6


def serve_requests(stack: LocalStack, count: int) -> None:
    """Chats and prompts over the OpenAI API, prompts over gRPC: the templating, tokenizing and
    streaming paths each run."""
    client = OpenAI(base_url=stack.http_url, api_key="unused", timeout=120)
    for i in range(count):
        client.chat.completions.create(model="embedded", max_tokens=16, temperature=0, messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": f"Name a colour, please ({i})."}])
        client.completions.create(model="embedded", max_tokens=16, temperature=0,
                                  prompt=f"Once upon a time, number {i},")
        request = generation_pb2.GenerateRequest(prompt=f"The history of the sea, part {i}:", max_tokens=16)
        list(stack.stub.Generate(request, timeout=120))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20, help="of each kind: chat, prompt, gRPC prompt")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir, LocalStack(Path(workdir), MODEL_CACHE_DIR, services=("stack",)) as stack:
        pid = router_pid(stack.processes["stack"].pid)
        idle = memory_mb(pid)
        serve_requests(stack, args.requests)
        served = memory_mb(pid)
        mapped = gpu_libraries_mapped(pid)
    result = {
        "router_idle_rss_mb": round(idle["rss_mb"], 1),
        "router_rss_mb": round(served["rss_mb"], 1),
        "router_peak_mb": round(served["peak_mb"], 1),
        "requests": 3 * args.requests,
        "budget_mb": BUDGET_MB,
        "torch_and_transformers_import_mb": round(torch_interpreter_mb(), 1),
        "gpu_libraries_mapped": mapped,
    }
    result["within_budget"] = served["peak_mb"] < BUDGET_MB and not mapped
    emit(result, args.out)
    return 0 if result["within_budget"] else 1


if __name__ == "__main__":
    sys.exit(main())
