"""AIPerf (NVIDIA's load tool) replaying a Mooncake trace against the OpenAI API of a running stack:
`make loadtest TOOL=aiperf`, or

    .venv/bin/python -m loadtest.external.aiperf_replay --url http://127.0.0.1:8000 [--trace FILE] [--out DIR]

AIPerf sends each trace row at its timestamp (open loop) to /v1/chat/completions, streamed, with a
prompt it builds from the row's hash_ids (equal ids, equal blocks of text) and max_completion_tokens
of its output length, which ignore_eos makes exact. This prints AIPerf's tables and exits 1 unless
every request of the trace succeeded.

AIPerf runs from a venv of its own (AIPERF, .venv-aiperf, which the Makefile makes): aiperf 0.13.0
pins pyzmq, psutil, prometheus-client, rich and huggingface-hub below the versions the stack runs
on, and installed into .venv it would move them back.

The default trace, loadtest/traces/mooncake_cpu.jsonl, is a CPU-sized slice of the Mooncake trace
made by `--make-trace` (cpu_slice below); loadtest/traces/README.md says where it comes from and
how it was cut.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from loadtest.lib.workload import DEFAULT_TRACE, REPO, TraceRecord, TraceScaling, read_trace, scaled_lengths

AIPERF = REPO / ".venv-aiperf" / "bin" / "aiperf"
CPU_TRACE = REPO / "loadtest" / "traces" / "mooncake_cpu.jsonl"
CPU_SCALING = TraceScaling(length_scale=1 / 32, max_input_tokens=512, max_output_tokens=32, replay_seconds=60.0)
SUMMARY = "profile_export_aiperf.json"  # AIPerf's aggregate metrics, in the artifact folder


def cpu_slice(records: list[TraceRecord], every: int = 6, scaling: TraceScaling = CPU_SCALING) -> list[dict]:
    """Every `every`-th request before scaling.replay_seconds (the trace's own clock), lengths scaled;
    each row keeps the hash ids its scaled input covers, so AIPerf rebuilds the shared prefixes."""
    rows = []
    for index, record in enumerate(records):
        if record.timestamp_ms >= scaling.replay_seconds * 1000:
            break
        if index % every == 0:
            input_length, output_length = scaled_lengths(record, scaling)
            blocks = -(-input_length // scaling.block_tokens)
            rows.append({"timestamp": record.timestamp_ms, "input_length": input_length,
                         "output_length": output_length, "hash_ids": list(record.hash_ids[:blocks])})
    return rows


def write_trace(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def aiperf_command(args: argparse.Namespace) -> list[str]:
    command = [str(args.aiperf), "profile", "--url", args.url, "--model", args.model, "--tokenizer", args.tokenizer,
               "--endpoint-type", "chat", "--streaming", "--input-file", str(args.trace),
               "--custom-dataset-type", "mooncake_trace", "--fixed-schedule",
               "--isl-block-size", str(CPU_SCALING.block_tokens), "--extra-inputs", "ignore_eos:true",
               # The router's counts: the chat template's tokens are part of the prompt it ran.
               "--use-server-token-count",
               "--random-seed", "0", "--request-timeout-seconds", str(args.request_timeout_s),
               "--artifact-dir", str(args.out), "--ui", "none"]
    return command + (["--api-key", args.api_key] if args.api_key else [])


def outcome(summary: dict) -> tuple[int, int]:
    """(requests that succeeded, requests that failed) of AIPerf's summary, which leaves out a count of none."""
    def count(name: str) -> int:
        return int(summary.get(name, {}).get("avg", 0))

    return count("request_count"), count("error_request_count")


def tokenizer_cache(checkpoint: Path, cache: Path) -> str:
    """The checkpoint's tokenizer as a repo in a Hugging Face cache folder of its own; returns the repo id.

    AIPerf builds the prompts with the served model's tokenizer, in worker processes that load it
    offline from the Hugging Face cache: a plain folder path fails there (aiperf 0.13.0 hands it to
    snapshot_download, which refuses a path as a repo id). Run AIPerf with HF_HUB_CACHE=cache.
    """
    repo, revision = "pdserve/served-model", "0" * 40
    snapshot = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for source in checkpoint.iterdir():
        if source.suffix in (".json", ".jinja") and not (snapshot / source.name).exists():
            (snapshot / source.name).symlink_to(source)
    (snapshot.parent.parent / "refs").mkdir(exist_ok=True)
    (snapshot.parent.parent / "refs" / "main").write_text(revision)
    return repo


def _served_checkpoint(model_path: str) -> Path:
    from shared.model.loader import resolve_checkpoint

    return Path(resolve_checkpoint(model_path, "~/.cache/pdserve"))


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.external.aiperf_replay",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the stack's router.http_address")
    parser.add_argument("--model", default="embedded", help="router.served_model_name, or model.path")
    parser.add_argument("--tokenizer", type=Path, help="the served checkpoint's folder; default: that of --model")
    parser.add_argument("--api-key", help="the router's bearer token, if it has one")
    parser.add_argument("--trace", type=Path, default=CPU_TRACE, help="a Mooncake-format JSONL trace")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "aiperf", help="AIPerf's artifact folder")
    parser.add_argument("--aiperf", type=Path, default=AIPERF, help="the aiperf executable")
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--make-trace", type=Path, metavar="PATH",
                        help="write the CPU slice of the Mooncake trace (cpu_slice) to PATH, and exit")
    args = parser.parse_args()
    if args.make_trace:
        write_trace(cpu_slice(read_trace(DEFAULT_TRACE)), args.make_trace)
        return 0
    cache = args.out / "hf-cache"
    args.tokenizer = tokenizer_cache(args.tokenizer or _served_checkpoint(args.model), cache)
    # Offline: nothing AIPerf needs is on the Hub, and it must not try to reach it.
    ran = subprocess.run(aiperf_command(args), env={**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    summary_path = args.out / SUMMARY
    if ran.returncode != 0 or not summary_path.exists():
        print(f"aiperf_replay: aiperf exited {ran.returncode} without {summary_path}", file=sys.stderr)
        return 1
    sent = sum(1 for line in args.trace.read_text().splitlines() if line.strip())
    succeeded, failed = outcome(json.loads(summary_path.read_text()))
    print(f"aiperf_replay: {sent} requests in the trace, {succeeded} succeeded, {failed} failed")
    return 0 if succeeded == sent and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
