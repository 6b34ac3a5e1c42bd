"""The GPU path: CUDA IPC handoff, CUDA-graph decode, stream priority, and the stack on a GPU.

Run with `make test-gpu` (pytest -m gpu) on a machine with CUDA; on the CPU every test skips.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from shared.kv.pages import PageAllocator, pages_for
from shared.kv.pool import allocate_local_pool, make_layout
from tests.stack import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

EIGHT_B_KV = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def test_cuda_ipc_handoff_of_32k_tokens_is_bit_identical(tmp_path):
    """A prefill-side pool exported by CUDA IPC, pulled by another process into its own pool."""
    from shared.control import wire
    from shared.kv.transfer import export_pool

    tokens, page_size = 32 * 1024, 16
    layout = make_layout(num_pages=pages_for(tokens, page_size) + 64, page_size=page_size, **EIGHT_B_KV)
    exported = export_pool(layout, "gpu-test", "cuda:0")
    src_pages = torch.randperm(layout.num_pages, device="cuda")[: pages_for(tokens, page_size)]
    exported.pool.kv[:, src_pages] = torch.randn(exported.pool.kv[:, src_pages].shape, device="cuda",
                                                 dtype=torch.bfloat16)
    expected = exported.pool.kv[:, src_pages].view(torch.int16).double().sum().item()
    torch.cuda.synchronize()
    (tmp_path / "handle").write_bytes(wire.encode(_pool_message(exported.handles)))
    (tmp_path / "pages").write_text(",".join(map(str, src_pages.tolist())))
    child = textwrap.dedent(f"""
        import sys, time, torch
        from pathlib import Path
        from shared.control import wire
        from shared.kv.pool import allocate_local_pool
        from shared.kv.transfer.cuda_ipc import CudaIpcBackend
        handle = wire.decode(Path({str(tmp_path / 'handle')!r}).read_bytes()).pool_handles[0]
        src = torch.tensor([int(p) for p in Path({str(tmp_path / 'pages')!r}).read_text().split(",")], device="cuda")
        mapped = CudaIpcBackend.map_pool(handle, torch.device("cuda:0"))
        local, _ = allocate_local_pool(handle.layout, "cuda:0")
        dst = torch.arange(len(src), device="cuda")
        local.copy_pages_from(mapped.pool, src, dst)
        torch.cuda.synchronize()
        assert torch.equal(local.kv[:, dst], mapped.pool.kv[:, src])
        print(local.kv[:, dst].view(torch.int16).double().sum().item())
    """)
    out = subprocess.run([sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.split()[-1]) == expected
    exported.close()


def _pool_message(handles):
    from shared.control.messages import PoolAvailable

    return PoolAvailable("prefill-test", handles)


def test_pull_lands_only_after_the_device_copied_it(tmp_path):
    """A decode's pulls queued behind 0.2 s of other device work: landed() reports none before the
    copies ran, then dates each after the stall, not at its launch. The third pull wraps the
    page-id staging buffer while the copies reading it still wait; unmapping the pool waits for the
    copies still reading it."""
    from shared.control import wire
    from shared.kv.transfer import export_pool

    layout = make_layout(num_pages=512, page_size=16, **EIGHT_B_KV)  # 1 GiB
    exported = export_pool(layout, "pull-test", "cuda:0")
    exported.pool.kv.copy_(torch.randn(exported.pool.kv.shape, device="cuda", dtype=torch.bfloat16))
    expected = [exported.pool.kv[:, list(pages)].view(torch.int16).double().sum().item()
                for pages in (range(100, 228), range(380, 508))]
    torch.cuda.synchronize()
    (tmp_path / "handle").write_bytes(wire.encode(_pool_message(exported.handles)))
    child = textwrap.dedent(f"""
        import time, torch
        from pathlib import Path
        from services.decode.kv_pull import KvPuller
        from shared.control import wire
        from shared.kv.pool import allocate_local_pool, make_layout
        from shared.control.messages import DecodeTask, SamplingParams, StopParams
        handle = wire.decode(Path({str(tmp_path / 'handle')!r}).read_bytes()).pool_handles[0]
        shape = handle.layout
        local, _ = allocate_local_pool(make_layout(shape.num_layers, 257, shape.page_size, shape.num_kv_heads,
                                                   shape.head_dim, torch.bfloat16), "cuda:0")
        puller = KvPuller(local, 256, lambda pages: None)  # stages up to 2 x 257 + 2 page ids
        puller.map_pool("prefill-test", [handle])

        def pull(request_id, src, dst):
            task = DecodeTask(request_id, "prefill-test", wire.pack_page_ids(list(src)), 16 * len(src), 7,
                              SamplingParams(0, 1, 0, 0), StopParams(4, True))
            puller.pull(task, list(dst))

        pull("warm-up", [0], [0])  # compiles the kernel before the clock starts
        torch.cuda.synchronize()
        assert [p.request_id for p in puller.landed()] == ["warm-up"]
        torch.cuda._sleep(400_000_000)  # at least 0.2 s at any clock up to 2 GHz
        started = time.perf_counter()
        pull("a", range(100, 228), range(0, 128))
        pull("b", range(300, 364), range(128, 192))
        assert puller.copying and puller.landed() == [], "reported before the device copied"
        pull("c", range(380, 508), range(128, 256))  # its ids overwrite a's slice: a's copy must be done
        puller.unmap_pool("prefill-test")
        landed = puller.landed()
        seen = time.perf_counter()
        assert [p.request_id for p in landed] == ["a", "b", "c"], landed
        assert all(started + 0.1 < p.landed.at <= seen for p in landed), (started, seen, landed)
        assert landed[0].landed.at <= landed[1].landed.at <= landed[2].landed.at
        print(*[local.kv[:, list(pages)].view(torch.int16).double().sum().item()
                for pages in (range(0, 128), range(128, 256))])
    """)
    out = subprocess.run([sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert [float(v) for v in out.stdout.split()[-2:]] == expected
    exported.close()


def test_a_step_launched_before_its_copy_ended_is_dated_after_it_on_the_device():
    """The decode queue's two ends: the copy's end and the step's start. The host launches the step
    while the copy still waits behind other work (here a sleep kernel): by the host's launch time
    the step began 0.2 s before the copy ended (the H200 run's -0.083 s decode queue). Dated on the
    device, it began after it, and the wait between them is the device's own."""
    from shared.kernels.device import date_moments, mark

    device = torch.device("cuda:0")
    source = torch.randn(1 << 20, device=device)
    target = torch.empty_like(source)
    with torch.cuda.stream(torch.cuda.Stream(device)):
        torch.cuda._sleep(400_000_000)  # at least 0.2 s at any clock up to 2 GHz
        target.copy_(source)
        copied = mark(device)  # as the decode's copy records its event (shared/kv/transfer/local_copy.py)
        launched = time.perf_counter()
        step = mark(device)
        date_moments([copied, step], device)
    assert launched < copied.at - 0.1  # the host's stamp: a negative queue
    assert copied.seconds_until(step) >= 0  # the device's: two events of one stream
    assert step.at - copied.at == pytest.approx(copied.seconds_until(step), abs=1e-4)  # dated by one probe


def test_decode_stream_has_the_highest_priority():
    from shared.kernels.device import worker_stream

    high = worker_stream(torch.device("cuda:0"), high_priority=True)
    normal = worker_stream(torch.device("cuda:0"), high_priority=False)
    assert high.priority < normal.priority  # lower number, higher priority


def test_graphed_decode_equals_eager():
    from shared.model.from_checkpoint import load_paged_llama
    from tests.decode_inputs import assert_graph_replay_equals_eager

    assert_graph_replay_equals_eager(load_paged_llama("random:llama-tiny", "float32", "cuda:0"))


def test_short_steps_over_a_long_context_table_replay_the_narrow_capture():
    """A page table of 256K tokens gives batch 1 the attention's wide tiles; the bucket is also
    captured over a table of SHORT_CONTEXT tokens, which a step of a shorter sequence replays and a
    longer one does not. Either replay computes the eager step."""
    from services.decode.cuda_graphs import SHORT_CONTEXT, GraphedDecode
    from shared.kernels.decode_tiling import LONG_CONTEXT
    from shared.model.from_checkpoint import load_paged_llama
    from tests.decode_inputs import PAGE_SIZE, prefilled_step_inputs

    model = load_paged_llama("random:llama-tiny", "float32", "cuda:0")
    layout = model.kv_layout(1024, PAGE_SIZE)
    pool, _ = allocate_local_pool(layout, "cuda:0")
    allocator = PageAllocator(layout.num_pages)
    graphs = GraphedDecode(model, pool, allocator.allocate(1)[0], LONG_CONTEXT // PAGE_SIZE, [1, 8])
    assert set(graphs.short) == {1}  # batch 8 takes the wide tiles at any width
    replays = []

    class Named:  # the captured graph, noting its replays
        def __init__(self, graph, name):
            self.graph, self.name = graph, name

        def replay(self):
            replays.append(self.name)
            self.graph.replay()

    graphs.short[1].graph = Named(graphs.short[1].graph, "narrow")
    graphs.captured[1].graph = Named(graphs.captured[1].graph, "full")
    for length, expected in ((40, "narrow"), (SHORT_CONTEXT + 100, "full")):
        inputs = prefilled_step_inputs(model, pool, allocator, [length])
        kv_before = pool.kv.clone()
        graphed = graphs.step(inputs).clone()
        pool.kv.copy_(kv_before)
        eager = model.decode(inputs.token_ids, inputs.positions, inputs.page_table, pool)
        torch.testing.assert_close(graphed, eager, atol=1e-4, rtol=1e-4)
        assert replays.pop() == expected and not replays


def test_programmatic_launch_leaves_the_step_bit_identical():
    """PDL lets a kernel start while the one before it drains; every kernel waits before it touches
    memory, so a graphed bf16 step gives the same bits with and without it."""
    from services.decode.cuda_graphs import GraphedDecode
    from services.decode.step_inputs import DecodingRequest, step_inputs
    from shared.control.messages import SamplingParams, StopParams
    from shared.kernels import triton_support
    from shared.model.from_checkpoint import load_paged_llama

    device = torch.device("cuda:0")
    assert triton_support.pdl_options(device)["USE_PDL"] == (torch.cuda.get_device_capability(0) >= (9, 0))
    model = load_paged_llama("random:llama-tiny", "bfloat16", "cuda:0")
    layout = model.kv_layout(512, 16)
    pool, _ = allocate_local_pool(layout, "cuda:0")
    allocator = PageAllocator(layout.num_pages)
    scratch = allocator.allocate(1)[0]
    requests = []
    for i in range(12):
        length = 5 + 37 * i
        pages = allocator.allocate(pages_for(length + 8, 16))
        model.prefill([3 + (7 * j + i) % 1000 for j in range(length)], pool, pages)
        requests.append(DecodingRequest(f"r{i}", pages, length, 7 + i, 1, SamplingParams(0, 1, 0, 0),
                                        StopParams(8, True)))
    inputs = step_inputs(requests, 16, device)
    kv_before = pool.kv.clone()
    with_pdl = GraphedDecode(model, pool, scratch, 64, [16]).step(inputs).clone()
    kv_with_pdl = pool.kv.clone()
    pool.kv.copy_(kv_before)
    triton_support.allow_pdl(False)
    try:
        without_pdl = GraphedDecode(model, pool, scratch, 64, [16]).step(inputs).clone()
    finally:
        triton_support.allow_pdl(True)
    assert torch.equal(with_pdl, without_pdl)
    assert torch.equal(kv_with_pdl, pool.kv)


def test_stack_on_gpu_matches_transformers(tmp_path):
    """The whole stack on the GPU in float32 (a random-weight Llama, built from the same seed in
    every process) against transformers' generate on the same weights."""
    from pdserve.v1 import generation_pb2
    from shared.model.presets import random_hf_model
    from tests.conftest import CACHE_DIR
    from tests.reference import assert_matches_reference, reference_greedy
    from tests.stack import ServiceStack

    model_path = "random:llama-tiny"
    reference = random_hf_model(model_path, torch.float32, "cuda:0")
    prompts = [[1, 5, 9, 200, 31, 7], list(range(10, 90)), [3] * 40 + [17, 19, 23]]
    settings = {"PDSERVE_MODEL_PATH": model_path, "PDSERVE_MODEL_DEVICE": "cuda:0", "PDSERVE_MODEL_DTYPE": "float32"}
    references = [reference_greedy(reference, prompt, 16) for prompt in prompts]

    def generate(prompt: list[int]) -> list[int]:
        request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=16, temperature=0)
        return [t for chunk in stack.stub.Generate(request, timeout=120) for t in chunk.token_ids]

    with ServiceStack(tmp_path, CACHE_DIR, **settings) as stack:
        for prompt, (expected, logits) in zip(prompts, references):
            assert_matches_reference(generate(prompt), expected, logits, f"gpu prompt of {len(prompt)}")
        with ThreadPoolExecutor(len(prompts)) as pool:  # batched together in the decode's graphs
            for prompt, ids, (expected, logits) in zip(prompts, pool.map(generate, prompts), references):
                assert_matches_reference(ids, expected, logits, f"concurrent gpu prompt of {len(prompt)}")
        stack.assert_pools_drained()


def test_fused_gpu_decode_equals_the_cpu_path():
    """The decode step with fused Triton kernels on the GPU against the plain PyTorch path on the CPU."""
    from shared.model.llama import PagedLlama
    from shared.model.presets import random_hf_model

    hf = random_hf_model("random:llama-tiny", torch.float32, "cuda:0")
    gpu = PagedLlama.from_hf(hf, "cuda:0")
    cpu = PagedLlama.from_hf(hf.cpu(), "cpu")
    layout = gpu.kv_layout(16, 16)
    pools = {"cuda:0": allocate_local_pool(layout, "cuda:0")[0], "cpu": allocate_local_pool(layout, "cpu")[0]}
    logits = {}
    for device, model in (("cuda:0", gpu), ("cpu", cpu)):
        pool = pools[device]
        model.prefill(list(range(5, 45)), pool, [3, 7, 1])
        model.prefill(list(range(60, 73)), pool, [9])
        logits[device] = model.decode(torch.tensor([11, 12], device=device), torch.tensor([40, 13], device=device),
                                      torch.tensor([[3, 7, 1], [9, 0, 0]], device=device), pool)
    torch.testing.assert_close(logits["cuda:0"].cpu(), logits["cpu"], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_after_a_cached_prefix_on_the_gpu_equals_the_whole_prefill(dtype):
    """A prompt whose first 64 tokens' KV another prompt wrote (the prefix cache's case): SDPA's
    lower-right causal mask on the GPU (flash attention in bfloat16) gives the whole prompt's logits."""
    from shared.model.llama import PagedLlama
    from shared.model.presets import random_hf_model

    model = PagedLlama.from_hf(random_hf_model("random:llama-tiny", dtype, "cuda:0"), "cuda:0")
    layout = model.kv_layout(32, 16)
    pool = allocate_local_pool(layout, "cuda:0")[0]
    prompt = list(range(5, 105))
    whole = model.prefill(prompt, pool, list(range(7))).float()
    model.prefill(prompt[:64] + [7, 8, 9], pool, [10, 11, 12, 13, 14])  # writes the shared 4 pages
    for chunk_tokens in (0, 16):
        cached = model.prefill(prompt, pool, [10, 11, 12, 13, 20, 21, 22], chunk_tokens, start=64).float()
        if dtype == torch.float32:
            torch.testing.assert_close(cached, whole, atol=1e-3, rtol=1e-3)
        else:  # bfloat16: the prefix's KV came out of another matmul shape; within rounding of the logits' scale
            assert (cached - whole).abs().max() <= 0.05 * whole.abs().max()


def test_decode_maps_the_prefill_weights(tmp_path):
    """decode.weights_from: one copy of the weights on the GPU; greedy tokens unchanged; the decode
    exits when the prefill that owns the weights is gone."""
    import signal

    from pdserve.v1 import generation_pb2
    from shared.model.presets import random_hf_model
    from tests.conftest import CACHE_DIR
    from tests.reference import assert_matches_reference, reference_greedy
    from tests.stack import ServiceStack

    model_path = "random:llama-tiny"
    reference = random_hf_model(model_path, torch.float32, "cuda:0")
    settings = {"PDSERVE_MODEL_PATH": model_path, "PDSERVE_MODEL_DEVICE": "cuda:0", "PDSERVE_MODEL_DTYPE": "float32",
                "PDSERVE_DECODE_WEIGHTS_FROM": "prefill-0", "PDSERVE_ROUTER_HEARTBEAT_TIMEOUT_S": "1.5",
                "PDSERVE_WORKER_HEARTBEAT_INTERVAL_S": "0.25"}
    with ServiceStack(tmp_path, CACHE_DIR, **settings) as stack:
        assert "mapped shared weights" in stack.log_path("decode").read_text()
        prompt = list(range(10, 60))
        request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=16, temperature=0)
        ids = [t for chunk in stack.stub.Generate(request, timeout=120) for t in chunk.token_ids]
        expected, logits = reference_greedy(reference, prompt, 16)
        assert_matches_reference(ids, expected, logits, "shared weights")
        stack.signal("prefill", signal.SIGKILL)
        assert stack.processes["decode"].wait(timeout=30) == 1
        assert "is gone" in stack.log_path("decode").read_text()


_PEER = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from shared.control import wire
    from shared.kv.transfer.cuda_ipc import CudaIpcBackend
    mapped = CudaIpcBackend.map_pool(wire.decode(Path(sys.argv[1]).read_bytes()).pool_handles[0], torch.device("cuda:0"))
    checksum = lambda: mapped.pool.kv.view(torch.int16).double().sum().item()
    print(checksum(), flush=True)
    for line in sys.stdin:  # each line read: checksum again
        print(checksum(), flush=True)
""")


def _peer(handle_file):
    return subprocess.Popen([sys.executable, "-c", _PEER, str(handle_file)], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _exported_pool(tmp_path):
    from shared.control import wire
    from shared.kv.transfer import export_pool

    layout = make_layout(num_pages=512, page_size=16, **EIGHT_B_KV)  # 1 GiB
    exported = export_pool(layout, "lifetime", "cuda:0")
    exported.pool.kv.copy_(torch.randn(exported.pool.kv.shape, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    (tmp_path / "handle").write_bytes(wire.encode(_pool_message(exported.handles)))
    return exported, exported.pool.kv.view(torch.int16).double().sum().item()


def test_exported_pool_outlives_the_exporters_own_references_while_mapped(tmp_path):
    exported, expected = _exported_pool(tmp_path)
    peer = _peer(tmp_path / "handle")
    try:
        assert float(peer.stdout.readline()) == expected
        exported.close()  # the exporter lets go; the peer still maps the memory
        import gc
        gc.collect()
        torch.cuda.empty_cache()
        peer.stdin.write("again\n")
        peer.stdin.flush()
        assert float(peer.stdout.readline()) == expected
    finally:
        peer.kill()
        peer.wait()


def test_dead_peers_leak_no_device_memory(tmp_path):
    import signal

    exported, expected = _exported_pool(tmp_path)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    for _ in range(3):
        peer = _peer(tmp_path / "handle")
        assert float(peer.stdout.readline()) == expected
        peer.send_signal(signal.SIGKILL)
        peer.wait()
    leaked = free_before - torch.cuda.mem_get_info()[0]
    assert leaked < 64 << 20, f"{leaked >> 20} MiB of device memory did not come back after peers died"
    survivor = _peer(tmp_path / "handle")  # the handle still maps after its earlier peers died
    try:
        assert float(survivor.stdout.readline()) == expected
    finally:
        survivor.kill()
        survivor.wait()
    exported.close()


# ---- placement: a decode on another GPU than its prefill, many workers on one GPU ----

_PULL_THROUGH_PEER_ACCESS = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from services.decode.kv_pull import HandoffError, KvPuller
    from shared.control import wire
    from shared.kernels.device import select_device
    from shared.kv.pool import allocate_local_pool, make_layout
    from shared.kv.transfer import cuda_ipc
    from shared.control.messages import DecodeTask, SamplingParams, StopParams

    handle_file, device, other = sys.argv[1], select_device(sys.argv[2]), int(sys.argv[3])  # as a worker starts
    handle = wire.decode(Path(handle_file).read_bytes()).pool_handles[0]
    shape = handle.layout
    local, _ = allocate_local_pool(make_layout(shape.num_layers, 129, shape.page_size, shape.num_kv_heads,
                                               shape.head_dim, torch.bfloat16), device)
    if other >= 0:  # pretend the pool is on GPU `other`, to run the peer-access path on one GPU
        cuda_ipc.device_index_of = lambda uuid: other
        answers, asked = [False, True], []
        torch.cuda.can_device_access_peer = lambda a, b: asked.append((a, b)) or answers[len(asked) - 1]
    puller = KvPuller(local, 128, lambda pages: None)
    if other >= 0:
        try:
            puller.map_pool("prefill-test", [handle])
            sys.exit("mapped without peer access")
        except HandoffError as exc:
            assert f"has no peer access to cuda:{other}" in str(exc), exc
    puller.map_pool("prefill-test", [handle])
    if other >= 0:
        assert asked == [(device.index, other)] * 2, asked
    task = DecodeTask("r", "prefill-test", wire.pack_page_ids(list(range(100, 228))), 16 * 128, 7,
                      SamplingParams(0, 1, 0, 0), StopParams(4, True))
    puller.pull(task, list(range(128)))
    torch.cuda.synchronize(device)
    assert [t.request_id for t in puller.landed()] == ["r"]
    print(local.kv[:, :128].view(torch.int16).double().sum().item())
""")


def _pull_in_a_child(tmp_path, device: str, pretend_other: int) -> tuple[float, float]:
    """Pages 100-227 of a pool exported here on cuda:0, pulled by a decode process on `device`:
    the checksum it saw, and ours."""
    from shared.control import wire
    from shared.kv.transfer import export_pool

    layout = make_layout(num_pages=256, page_size=16, **EIGHT_B_KV)
    exported = export_pool(layout, "placement", "cuda:0")
    exported.pool.kv.copy_(torch.randn(exported.pool.kv.shape, device="cuda:0", dtype=torch.bfloat16))
    expected = exported.pool.kv[:, 100:228].view(torch.int16).double().sum().item()
    torch.cuda.synchronize()
    (tmp_path / "handle").write_bytes(wire.encode(_pool_message(exported.handles)))
    out = subprocess.run([sys.executable, "-c", _PULL_THROUGH_PEER_ACCESS, str(tmp_path / "handle"), device,
                          str(pretend_other)], cwd=REPO, capture_output=True, text=True, timeout=300)
    exported.close()
    assert out.returncode == 0, out.stderr
    return float(out.stdout.split()[-1]), expected


def test_the_peer_access_path_pulls_bit_identical_pages_on_one_gpu(tmp_path):
    """The cross-GPU code path (the exporter's GPU found by UUID elsewhere, peer access checked,
    the handle opened on the decode's own device) run with both sides on cuda:0: refused without
    peer access, then the same batched copy as on one GPU."""
    pulled, expected = _pull_in_a_child(tmp_path, "cuda:0", pretend_other=1)
    assert pulled == expected


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not torch.cuda.can_device_access_peer(1, 0),
                    reason="needs two GPUs with peer access")
def test_a_decode_on_another_gpu_pulls_over_peer_access(tmp_path):
    pulled, expected = _pull_in_a_child(tmp_path, "cuda:1", pretend_other=-1)
    assert pulled == expected


def test_the_exporters_gpu_is_found_by_uuid():
    from shared.kernels.device import device_uuid
    from shared.kv.transfer import TransferError
    from shared.kv.transfer.cuda_ipc import device_index_of

    assert device_index_of(device_uuid(torch.device("cuda:0"))) == 0
    with pytest.raises(TransferError, match="is not visible to this process"):
        device_index_of("GPU-00000000-0000-0000-0000-000000000000")


def test_a_worker_on_a_gpu_other_than_the_first_runs_there():
    """Everything the worker queues without naming a device goes to its own (select_device)."""
    from shared.kernels.device import on_stream, select_device, worker_stream

    device = select_device(f"cuda:{torch.cuda.device_count() - 1}")
    assert torch.cuda.current_device() == device.index
    with on_stream(worker_stream(device, high_priority=True)):
        assert torch.cuda.current_stream().device == device
    select_device("cuda:0")


EIGHT_B_STACK = {"PDSERVE_MODEL_PATH": "random:llama-3.1-8b", "PDSERVE_MODEL_DEVICE": "cuda:0",
                 "PDSERVE_MODEL_DTYPE": "bfloat16", "PDSERVE_KV_PREFILL_PAGES": "1024",
                 "PDSERVE_KV_DECODE_PAGES": "2048", "PDSERVE_DECODE_CUDA_GRAPH_BATCH_SIZES": "1,2,4,8",
                 "PDSERVE_DECODE_MAX_BATCH_SIZE": "8"}


@pytest.mark.parametrize("prefill, decode", [(2, 1), (1, 2)], ids=["2 prefills 1 decode", "1 prefill 2 decodes"])
def test_many_workers_of_the_8b_shape_on_one_gpu(tmp_path, prefill, decode):
    """All registered; concurrent requests through every pair; then the first worker of the role
    that has two drains away, and the other serves alone. Two decodes share prefill-0's weights;
    two prefills each hold their own (the decode would exit with the prefill it maps them from)."""
    import signal

    from pdserve.v1 import generation_pb2
    from tests.conftest import CACHE_DIR
    from tests.stack import ServiceStack

    # No prefix cache: the same prompt again must be computed whole for its tokens to compare (in
    # bf16 a prompt computed after a cached prefix may round differently).
    settings = {**EIGHT_B_STACK, "PDSERVE_DECODE_WEIGHTS_FROM": "prefill-0" if decode > 1 else "",
                "PDSERVE_PREFILL_PREFIX_CACHE": "false"}
    prompts = [[(97 * i + 13 * j) % 128000 + 1 for j in range(500 + 300 * i)] for i in range(8)]

    def generate(prompt: list[int]) -> list[int]:
        request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=16, temperature=0,
                                                 ignore_eos=True)
        return [t for chunk in stack.stub.Generate(request, timeout=300) for t in chunk.token_ids]

    with ServiceStack(tmp_path, CACHE_DIR, prefill=prefill, decode=decode, start_timeout_s=900, **settings) as stack:
        expected = {f"prefill-{i}" for i in range(prefill)} | {f"decode-{i}" for i in range(decode)}
        assert {w.worker_id for w in stack.workers()} == expected
        with ThreadPoolExecutor(len(prompts)) as pool:
            assert [len(ids) for ids in pool.map(generate, prompts)] == [16] * len(prompts)
        first = generate(prompts[0])
        role = "prefill" if prefill > 1 else "decode"
        stack.signal(role, signal.SIGTERM)  # its first worker drains and exits 0
        assert stack.processes[role].wait(timeout=120) == 0
        while f"{role}-0" in {w.worker_id for w in stack.workers()}:
            time.sleep(0.1)
        again = generate(prompts[0])
        if role == "prefill":  # the same decode, fed by the other prefill
            assert again == first
        assert len(again) == 16
        stack.assert_pools_drained()


def test_shared_weights_are_refused_on_another_gpu(tmp_path, monkeypatch):
    """map_weights compares the GPU the weights file names with the decode's, before opening any
    handle; here the decode's GPU is made to look like another one."""
    from shared.model import weight_share
    from shared.model.from_checkpoint import load_paged_llama
    from shared.model.presets import preset_config

    model = load_paged_llama("random:llama-tiny", "float32", "cuda:0")
    path = tmp_path / "weights.msgpack"
    weight_share.publish_weights(model, path)
    monkeypatch.setattr(weight_share, "device_uuid", lambda device: "GPU-another")
    with pytest.raises(weight_share.WeightsOnAnotherGpu, match="shares weights on one GPU only") as refused:
        weight_share.map_weights(preset_config("random:llama-tiny"), path, "cuda:0", timeout_s=1)
    assert refused.value.exit_code == 2
