"""AIPerf, NVIDIA's load tool, replays a slice of the Mooncake trace against the real stack's OpenAI
API (loadtest/external/aiperf_replay.py): every request must succeed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loadtest.external.aiperf_replay import AIPERF, CPU_TRACE, write_trace
from tests.stack import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.skipif(not AIPERF.exists(), reason="AIPerf has a venv of its own: `make loadtest TOOL=aiperf` makes it")
def test_an_aiperf_trace_replay_ends_without_errors(stack, tmp_path):
    rows = [json.loads(line) for line in CPU_TRACE.read_text().splitlines()][:8:2]  # 4 requests in 9 s, 2 at once
    write_trace(rows, tmp_path / "trace.jsonl")
    url = stack.http_url.removesuffix("/v1")
    replay = subprocess.run([sys.executable, "-m", "loadtest.external.aiperf_replay", "--url", url,
                             "--trace", str(tmp_path / "trace.jsonl"), "--out", str(tmp_path / "aiperf")],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]
    assert f"{len(rows)} requests in the trace, {len(rows)} succeeded, 0 failed" in replay.stdout
    stack.assert_pools_drained()
