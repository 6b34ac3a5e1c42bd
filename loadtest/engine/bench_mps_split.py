"""Which SM split should a prefill and a decode process sharing one GPU under MPS get? (JSON on stdout)

    python -m loadtest.engine.bench_mps_split [--window-s 15] [--arrangements mps-100-50,mps-70-50] [--out FILE]

Each arrangement starts fresh child processes (`--role decode|prefill`), each building the random
8B model (bf16, same seed) on cuda:0 as the workers do, and times them side by side:
- decode: batch 32 at 2K context, each step one CUDA graph replay (services/decode/cuda_graphs.py),
  timed by CUDA events and synchronized per step, for the whole window;
- prefill: 8K-token prompts back to back; its rate counts the prompts finished inside the window
  over the time they took (the one still running at the window's end is dropped).
Arrangements: `decode-alone` and `prefill-alone` (the baselines, always run: every ratio is to
them), `no-mps` (both, time-sliced), and `mps-D-P`: under the MPS daemon, decode limited to D% of
the SMs and prefill to P% (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, unset for 100). The arrangements
without MPS run first, with no daemon; this process then starts its own daemon in fresh pipe and
log folders, checks that both children are its clients, and quits it at the end, also on error.

`recommended` is the two-process arrangement with the highest prefill rate among those whose decode
p99 is within --max-p99-ratio (1.5) of decode-alone's, else the one with the lowest decode p99; its
`env` is what deploy/mps/run-on-one-gpu.sh takes. Arrangements that would end past --time-limit-s
are skipped, so an outer timeout never cuts the run (and its cleanup) short; the exit code is 1
when anything failed, was skipped, or MPS could not be confirmed.

The children speak JSON lines on stdout (ready, result, or error) and wait on stdin for "go", so
both windows start together. This process never touches CUDA: an MPS client's SM share is fixed
when its CUDA context is created, so every share needs its own processes.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from loadtest.lib.decode_batch import decode_batch, request_pages
from loadtest.lib.device_rates import cuda_time_ms
from loadtest.lib.model_costs import prefill_flops
from loadtest.lib.mps_daemon import MpsDaemon, find_mps_control, run_quiet, tail
from loadtest.lib.percentiles import quantile
from loadtest.lib.report import emit
from services.decode.cuda_graphs import GraphedDecode
from services.stack.supervisor import Service, Supervisor
from shared.kernels.device import on_stream, worker_stream
from shared.kv.pages import PageAllocator, pages_for
from shared.kv.pool import allocate_local_pool
from shared.model import presets
from shared.model.llama import PagedLlama
from shared.runtime.process import die_with_parent
from shared.worker.cores import pin_to_cores

DEVICE = "cuda:0"
PAGE_SIZE = 16
DEFAULT_ARRANGEMENTS = "no-mps,mps-100-100,mps-100-50,mps-100-70,mps-70-50,mps-50-50,mps-60-60,mps-100-30"
BASELINES = ("decode-alone", "prefill-alone")
# NVLink multicast can take a shared host's GPUs out of service; nothing here needs it.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
CHILD_MODULE = "loadtest.engine.bench_mps_split"
STARTED = time.monotonic()  # a child's setup time counts from here


# ---- arrangements -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Arrangement:
    name: str
    roles: tuple[str, ...]
    mps: bool
    decode_percent: int | None = None   # SM share under MPS; None: no limit
    prefill_percent: int | None = None

    def percent(self, role: str) -> int | None:
        return self.decode_percent if role == "decode" else self.prefill_percent


def parse_arrangement(name: str) -> Arrangement:
    fixed = {"decode-alone": ("decode",), "prefill-alone": ("prefill",), "no-mps": ("decode", "prefill")}
    if name in fixed:
        return Arrangement(name, fixed[name], mps=False)
    match = re.fullmatch(r"mps-(\d+)-(\d+)", name)
    if not match or not all(1 <= int(p) <= 100 for p in match.groups()):
        raise ValueError(f"unknown arrangement {name!r}: decode-alone, prefill-alone, no-mps or "
                         f"mps-D-P (decode and prefill SM percent, 1-100)")
    return Arrangement(name, ("decode", "prefill"), True, int(match[1]), int(match[2]))


def plan(names: str) -> list[Arrangement]:
    """Baselines first, then the other arrangements without MPS, then those under MPS."""
    wanted = list(dict.fromkeys([*BASELINES, *filter(None, (n.strip() for n in names.split(",")))]))
    arrangements = [parse_arrangement(n) for n in wanted]
    return [a for a in arrangements if not a.mps] + [a for a in arrangements if a.mps]


def child_env(base: dict[str, str], arrangement: Arrangement, role: str, mps_env: dict[str, str]) -> dict[str, str]:
    env = {**base, **NO_MULTICAST, **mps_env, "PYTHONUNBUFFERED": "1"}
    env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)
    percent = arrangement.percent(role)
    if arrangement.mps and percent is not None and percent < 100:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(percent)
    return env


# ---- the children ---------------------------------------------------------------------------------

def build_model(path: str, seed: int) -> PagedLlama:
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: this benchmark needs a GPU (and the MPS daemon)")
    model = PagedLlama.from_hf(presets.random_hf_model(path, torch.bfloat16, DEVICE, seed=seed), DEVICE)
    torch.cuda.empty_cache()  # the unfused q/k/v and gate/up weights went with the HF module
    return model


def decode_pool_and_batch(model: PagedLlama, batch: int, context: int):
    """`batch` requests of `context` tokens in a pool laid out as the decode worker's: the graphs'
    scratch page past the allocator's pages, the graphs' page table as wide as the pool."""
    allocator = PageAllocator(batch * request_pages(context, PAGE_SIZE, spare_tokens=PAGE_SIZE))
    layout = model.kv_layout(allocator.num_pages + 1, PAGE_SIZE)
    pool, _ = allocate_local_pool(layout, model.device)
    inputs = decode_batch(allocator, [context] * batch, PAGE_SIZE, model.device, spare_tokens=PAGE_SIZE).inputs
    graph_pages = min(pages_for(model.max_context, PAGE_SIZE), layout.num_pages)
    return pool, allocator.num_pages, graph_pages, inputs


def decode_child(args, send) -> None:
    cores = pin_to_cores("", "upper")
    model = build_model(args.model, args.seed)
    stream = worker_stream(model.device, high_priority=True)
    with on_stream(stream):
        pool, scratch, max_pages, inputs = decode_pool_and_batch(model, args.decode_batch, args.decode_context)
        graphs = GraphedDecode(model, pool, scratch, max_pages, [args.decode_batch])
        if graphs.step(inputs) is None:
            raise RuntimeError(f"batch {args.decode_batch} did not run as a graph")

        def step():
            return graphs.step(inputs)

        cuda_time_ms(step, 1, warmup=20)
    send(ready_message("decode", cores))
    wait_for_go()
    times: list[float] = []
    with on_stream(stream):
        start = time.monotonic()
        while time.monotonic() < start + args.window_s:
            times += cuda_time_ms(step, 1, warmup=0)
        elapsed = time.monotonic() - start
    times.sort()
    send({"event": "result", "role": "decode", "steps": len(times), "window_s": elapsed,
          "tokens_per_s": args.decode_batch * len(times) / elapsed,
          "step_ms": {"p50": quantile(times, 0.5), "p90": quantile(times, 0.9), "p99": quantile(times, 0.99),
                      "mean": sum(times) / len(times), "max": times[-1]}})


def prefill_child(args, send) -> None:
    cores = pin_to_cores("", "lower")
    model = build_model(args.model, args.seed)
    stream = worker_stream(model.device, high_priority=False)
    pages = list(range(pages_for(args.prompt_tokens, PAGE_SIZE)))
    pool, _ = allocate_local_pool(model.kv_layout(len(pages), PAGE_SIZE), model.device)
    ids = torch.randint(0, model.vocab_size, (args.prompt_tokens,)).tolist()

    def run():
        return model.prefill(ids, pool, pages, args.chunk_tokens)

    with on_stream(stream):
        cuda_time_ms(run, 1, warmup=2)
    send(ready_message("prefill", cores))
    wait_for_go()
    times: list[float] = []
    with on_stream(stream):
        start = last = time.monotonic()
        while True:
            prompt_ms = cuda_time_ms(run, 1, warmup=0)[0]
            if time.monotonic() > start + args.window_s:
                break
            times.append(prompt_ms)
            last = time.monotonic()
    if not times:
        raise RuntimeError(f"no prompt finished within {args.window_s} s: lengthen --window-s")
    elapsed = last - start
    times.sort()
    send({"event": "result", "role": "prefill", "prompts": len(times), "window_s": elapsed,
          "prompts_per_s": len(times) / elapsed,
          "tflops": len(times) * prefill_flops(model, args.prompt_tokens) / elapsed / 1e12,
          "prompt_ms": {"p50": quantile(times, 0.5), "max": times[-1]}})


def ready_message(role: str, cores: list[int]) -> dict:
    properties = torch.cuda.get_device_properties(DEVICE)
    return {"event": "ready", "role": role, "pid": os.getpid(), "device": properties.name,
            "torch": torch.__version__, "sm_count": properties.multi_processor_count,
            "mps_thread_percent": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), "cpu_cores": cores,
            "setup_s": time.monotonic() - STARTED, "memory_gib": torch.cuda.memory_reserved(DEVICE) / (1 << 30)}


def wait_for_go() -> None:
    line = sys.stdin.readline()
    if line.strip() != "go":
        raise RuntimeError(f"expected 'go' from the orchestrator on stdin, got {line!r}")


def run_child(args) -> int:
    """Stdout carries only protocol lines: anything else printed (logs, warnings) goes to stderr."""
    die_with_parent()
    if os.getppid() != args.parent_pid:
        sys.exit(f"{args.role} child: the orchestrator (pid {args.parent_pid}) is gone")
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def send(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")

    try:
        (decode_child if args.role == "decode" else prefill_child)(args, send)
    except BaseException as error:
        send({"event": "error", "role": args.role, "error": f"{type(error).__name__}: {error}"})
        raise
    return 0


# ---- the orchestrator: processes, MPS, nvidia-smi -------------------------------------------------

class ArrangementFailed(RuntimeError):
    pass


class Child:
    def __init__(self, role: str, args: list[str], env: dict[str, str], log: Path, events: queue.Queue,
                 supervisor: Supervisor):
        self.role, self.log, self.events = role, log, events
        self.proc = supervisor.start(Service(role, CHILD_MODULE, ("--role", role, *args), env, log, pipes=True))

    def start_reader(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.events.put((self.role, json.loads(line)))
            except json.JSONDecodeError:
                self.events.put((self.role, {"event": "error", "error": f"not a protocol line: {line!r}"}))
        self.events.put((self.role, None))

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except OSError:
            raise ArrangementFailed(self.failure(f"could not be sent {line!r}")) from None

    def failure(self, what: str) -> str:
        try:
            code = self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            code = "still running"
        return f"{self.role} child {what} (exit code {code})\n--- the end of its stderr:\n{tail(self.log)}"

    def finish(self, grace_s: float) -> None:
        """A child exits by itself after its result (or at EOF while it waits for "go"); one that
        has not within grace_s is left to the supervisor's stop."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass  # already gone
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass


def collect(children: dict[str, Child], events: queue.Queue, event: str, timeout_s: float) -> dict[str, dict]:
    got: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(children):
        try:
            role, message = events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            missing = sorted(set(children) - set(got))
            raise ArrangementFailed(f"no {event!r} from {missing} within {timeout_s:.0f} s:\n"
                                    + "\n".join(tail(children[r].log) for r in missing)) from None
        if message is None and role in got and event == "result":
            continue  # a child exits once it has sent its result
        if message is None:
            raise ArrangementFailed(children[role].failure(f"exited before {event!r}"))
        if message.get("event") == "error":
            raise ArrangementFailed(children[role].failure(f"failed: {message.get('error')}"))
        if message.get("event") != event:
            raise ArrangementFailed(children[role].failure(f"sent {message} while {event!r} was awaited"))
        got[role] = message
    return {role: got[role] for role in children}


def smi(*args: str) -> str | None:
    done = run_quiet(["nvidia-smi", *args])
    return done.stdout if done is not None and done.returncode == 0 else None


def smi_process_types() -> dict[int, str]:
    """pid -> Type column of nvidia-smi's process table: C, G, or M+C for an MPS client."""
    types = {}
    for line in (smi() or "").splitlines():
        fields = line.strip("| ").split()
        if len(fields) >= 6 and fields[0].isdigit() and fields[3].isdigit() and re.fullmatch(r"[MCG+]+", fields[4]):
            types[int(fields[3])] = fields[4]
    return types


def check_mps(arrangement: Arrangement, daemon: MpsDaemon, pids: dict[str, int]) -> dict:
    """MPS is in use when the daemon lists both children as its server's clients, or nvidia-smi
    shows them as M+C; without MPS no daemon may answer and no child may be an M+C process."""
    types = smi_process_types()
    child_types = {role: types.get(pid) for role, pid in pids.items()}
    check = {"expected": arrangement.mps, "nvidia_smi_types": child_types}
    if arrangement.mps:
        servers = daemon.clients()
        clients = {pid for listed in servers.values() for pid in listed}
        check.update(servers=servers, children_are_clients=set(pids.values()) <= clients)
        check["verified"] = check["children_are_clients"] or all(t == "M+C" for t in child_types.values())
    else:
        check["daemon_answers"] = daemon.is_up()
        check["verified"] = not check["daemon_answers"] and "M+C" not in child_types.values()
    return check


def child_args(args) -> list[str]:
    return ["--parent-pid", str(os.getpid()), "--model", args.model, "--seed", str(args.seed),
            "--window-s", str(args.window_s), "--decode-batch", str(args.decode_batch),
            "--decode-context", str(args.decode_context), "--prompt-tokens", str(args.prompt_tokens),
            "--chunk-tokens", str(args.chunk_tokens)]


def run_arrangement(arrangement: Arrangement, args, daemon: MpsDaemon, logs: Path) -> dict:
    row: dict = {"name": arrangement.name, "mps": arrangement.mps, "decode_sm_percent": arrangement.decode_percent,
                 "prefill_sm_percent": arrangement.prefill_percent}
    started, events, children, measured = time.monotonic(), queue.Queue(), {}, False
    supervisor = Supervisor(grace_s=15)
    try:
        for role in arrangement.roles:
            env = child_env(dict(os.environ), arrangement, role, daemon.env)
            children[role] = Child(role, child_args(args), env, logs / f"{arrangement.name}-{role}.log", events,
                                   supervisor)
        for child in children.values():
            child.start_reader()
        row["children"] = collect(children, events, "ready", args.ready_timeout_s)
        row["mps_check"] = check_mps(arrangement, daemon, {r: c.proc.pid for r, c in children.items()})
        for child in children.values():
            child.send("go")
        results = collect(children, events, "result", args.window_s + 120)
        measured = True
        if "decode" in results:
            row.update(decode=results["decode"], decode_p50_ms=results["decode"]["step_ms"]["p50"],
                       decode_p99_ms=results["decode"]["step_ms"]["p99"])
        if "prefill" in results:
            row.update(prefill=results["prefill"], prefill_tflops=results["prefill"]["tflops"])
    except (ArrangementFailed, OSError) as error:
        row["error"] = str(error)
    finally:
        for child in children.values():
            child.finish(grace_s=60 if measured else 0)
        supervisor.stop()
    row["wall_s"] = time.monotonic() - started
    return row


# ---- the report -----------------------------------------------------------------------------------

def add_ratios(rows: list[dict]) -> None:
    by_name = {r["name"]: r for r in rows if "error" not in r}
    decode_alone, prefill_alone = by_name.get("decode-alone", {}), by_name.get("prefill-alone", {})
    for row in rows:
        for key, base, field in (("decode_p50_ratio", decode_alone, "decode_p50_ms"),
                                 ("decode_p99_ratio", decode_alone, "decode_p99_ms"),
                                 ("prefill_ratio", prefill_alone, "prefill_tflops")):
            if field in row and field in base:
                row[key] = row[field] / base[field]


def recommend(rows: list[dict], max_p99_ratio: float) -> dict:
    rule = (f"highest prefill TFLOP/s among the two-process arrangements (MPS verified where used) whose "
            f"decode p99 step is at most {max_p99_ratio}x decode-alone's; if none is, the lowest decode p99")
    candidates = [r for r in rows if "decode_p99_ratio" in r and "prefill_tflops" in r and r["mps_check"]["verified"]]
    qualified = [r for r in candidates if r["decode_p99_ratio"] <= max_p99_ratio]
    if not candidates:
        return {"rule": rule, "arrangement": None,
                "why": "no two-process arrangement measured (MPS verified where used) beside a decode-alone baseline"}
    best = max(qualified, key=lambda r: r["prefill_tflops"]) if qualified else min(
        candidates, key=lambda r: r["decode_p99_ms"])
    choice = {"rule": rule, "arrangement": best["name"], "qualified": [r["name"] for r in qualified],
              "by": "highest prefill rate within the p99 bound" if qualified else "lowest decode p99 (none within)",
              "decode_p99_ratio": best["decode_p99_ratio"], "prefill_ratio": best.get("prefill_ratio")}
    if best["mps"]:  # for deploy/mps/run-on-one-gpu.sh
        choice["env"] = {"PDSERVE_DECODE_SM_PERCENT": best["decode_sm_percent"],
                         "PDSERVE_PREFILL_SM_PERCENT": best["prefill_sm_percent"]}
    return choice


def progress(row: dict) -> str:
    if "error" in row:
        return f"{row['name']}: FAILED: {row['error']}"
    parts = [row["name"] + ":"]
    if "decode_p50_ms" in row:
        parts.append(f"decode p50 {row['decode_p50_ms']:.2f} ms, p99 {row['decode_p99_ms']:.2f} ms")
    if "prefill_tflops" in row:
        parts.append(f"prefill {row['prefill_tflops']:.0f} TFLOP/s")
    parts.append("SMs seen " + "/".join(f"{role} {c['sm_count']}" for role, c in row["children"].items()))
    if not row["mps_check"]["verified"]:
        parts.append(f"MPS {'NOT confirmed' if row['mps'] else 'unexpectedly in use'}: {row['mps_check']}")
    return " ".join(parts) + f" ({row['wall_s']:.0f} s)"


def orchestrate(args) -> int:
    started = time.monotonic()
    arrangements = plan(args.arrangements)
    control = find_mps_control()
    if control is None and any(a.mps for a in arrangements):
        sys.exit("bench_mps_split: nvidia-cuda-mps-control is not on PATH (nor in /usr/local/nvidia/bin, "
                 "/usr/bin); MPS arrangements cannot run")
    busy = [line for line in (smi("--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader")
                              or "").splitlines() if line.strip()]
    if busy:
        sys.exit(f"bench_mps_split: the GPU already runs compute processes (an MPS server counts): {busy}; "
                 "stop them first")
    gpu = (smi("--query-gpu=name,driver_version,memory.total,compute_mode", "--format=csv,noheader") or "").strip()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: children, daemon
    rows, skipped, aborted = [], [], None
    print(f"bench_mps_split: {len(arrangements)} arrangements, about {len(arrangements) * (args.window_s + 30):.0f} s",
          file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="pdserve-mps-") as work:
        daemon = MpsDaemon(control, Path(work) / "mps")
        try:
            for arrangement in arrangements:
                # An arrangement takes about as long as the longest so far: skip it rather than be
                # killed mid-way by an outer timeout, which would leave no report (and the daemon).
                expected = max((r["wall_s"] for r in rows), default=args.window_s + 30)
                if time.monotonic() - started + expected > args.time_limit_s:
                    skipped.append(arrangement.name)
                    continue
                if arrangement.mps and not daemon.started:
                    daemon.start()
                rows.append(run_arrangement(arrangement, args, daemon, Path(work)))
                print(f"[{len(rows)}/{len(arrangements)}] {progress(rows[-1])}", file=sys.stderr)
                if len(rows) == len(BASELINES) and all("error" in r for r in rows):
                    raise RuntimeError("both baselines failed: the other arrangements would fail the same way")
        except (KeyboardInterrupt, SystemExit, RuntimeError) as error:
            aborted = f"{type(error).__name__}: {error}"
            print(f"bench_mps_split: ABORTED: {aborted}", file=sys.stderr)
        finally:
            daemon_record = daemon.stop()
    add_ratios(rows)
    ready = next((c for r in rows for c in r.get("children", {}).values()), {})
    report = {
        "benchmark": "mps_split", "device": ready.get("device"), "torch": ready.get("torch"), "gpu": gpu,
        "model": args.model, "decode": {"batch": args.decode_batch, "context": args.decode_context},
        "prefill": {"prompt_tokens": args.prompt_tokens, "chunk_tokens": args.chunk_tokens},
        "window_s": args.window_s, "mps_control": control, "mps_daemon": daemon_record,
        "arrangements": rows, "recommended": recommend(rows, args.max_p99_ratio),
        "skipped_for_time": skipped, "aborted": aborted, "wall_s": time.monotonic() - started,
    }
    emit(report, args.out)
    problems = [progress(r).splitlines()[0] for r in rows if "error" in r or not r["mps_check"]["verified"]]
    problems += [f"MPS daemon not fully stopped: {daemon_record}"] if daemon_record.get("still_running") else []
    problems += [f"aborted: {aborted.splitlines()[0]}"] if aborted else []
    problems += [f"skipped to end within --time-limit-s {args.time_limit_s:.0f}: {skipped}"] if skipped else []
    if torch.cuda.is_initialized():
        problems.append("this process initialized CUDA: it must leave the GPU to its children")
    for problem in problems:
        print(f"bench_mps_split: PROBLEM: {problem}", file=sys.stderr)
    return 1 if problems else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.engine.bench_mps_split",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--arrangements", default=DEFAULT_ARRANGEMENTS,
                        help="comma-separated: no-mps, mps-D-P (decode-alone and prefill-alone always run)")
    parser.add_argument("--window-s", type=float, default=15.0, help="measured seconds per arrangement")
    parser.add_argument("--max-p99-ratio", type=float, default=1.5, help="decode p99 bound, times decode-alone's")
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--decode-context", type=int, default=2048)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--chunk-tokens", type=int, default=8192)
    parser.add_argument("--ready-timeout-s", type=float, default=180.0, help="model build and warm-up, per child")
    parser.add_argument("--time-limit-s", type=float, default=480.0,
                        help="start no arrangement expected to end past this many seconds from the start")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--role", choices=("decode", "prefill"), help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role and args.parent_pid is None:
        parser.error("--role is for the children this benchmark starts itself: run it without --role")
    for name in ("window_s", "max_p99_ratio", "decode_batch", "decode_context", "prompt_tokens", "ready_timeout_s",
                 "time_limit_s"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        parser.error(f"--out {args.out}: its folder does not exist")
    if args.chunk_tokens < 0:
        parser.error("--chunk-tokens must not be negative (0: the whole prompt at once)")
    try:
        plan(args.arrangements)
    except ValueError as error:
        parser.error(str(error))
    return args


if __name__ == "__main__":
    arguments = parse_args()
    sys.exit(run_child(arguments) if arguments.role else orchestrate(arguments))
