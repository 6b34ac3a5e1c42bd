"""What a checkpoint tells the stack beside its weights: a sliding window (each layer's, as
transformers applies it, served token-exact past it), and the sampling defaults of its generation_config.json (taken by the
router for the fields a request leaves unset). Each checkpoint is a tiny random one that the test
writes with transformers, the embedded model's tokenizer beside it."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config

from pdserve.v1 import generation_pb2
from shared.control import wire
from shared.control.messages import FinishReason, KvReady, PrefillTask, Registered, ReleaseKv, Role
from shared.model.fingerprint import model_fingerprint
from shared.model.generation_config import SamplingDefaults, sampling_defaults
from shared.kv.pages import pages_for
from shared.kv.pool import allocate_local_pool
from shared.model.from_checkpoint import load_paged_llama
from shared.model.loader import UnsupportedModel, layer_windows
from tests.conftest import CACHE_DIR
from tests.protocol_peer import ProtocolPeer
from tests.reference import assert_matches_reference, reference_greedy
from tests.stack import ServiceStack

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=49152, max_position_embeddings=256)  # the embedded tokenizer's vocabulary
LAYERS3 = {**TINY, "num_hidden_layers": 3}


def write_checkpoint(folder: Path, config, tokenizer_from: Path, generation: dict | None = None) -> Path:
    """A random model of that config, saved as transformers saves one, with the embedded tokenizer."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    (folder / "generation_config.json").unlink(missing_ok=True)  # transformers writes one of its own
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_from / name, folder / name)
    return folder


# ---- sliding windows ----

@pytest.mark.parametrize("config, windows", [
    (MistralConfig(**LAYERS3, sliding_window=48), [48, 48, 48]),
    (MistralConfig(**LAYERS3, sliding_window=None), [0, 0, 0]),
    (Qwen2Config(**LAYERS3, use_sliding_window=True, sliding_window=48, max_window_layers=1), [0, 48, 48]),
    (Qwen2Config(**LAYERS3, use_sliding_window=False, sliding_window=48), [0, 0, 0]),
    (Qwen3Config(**LAYERS3, use_sliding_window=True, sliding_window=48, max_window_layers=2), [0, 0, 48]),
    (MixtralConfig(**LAYERS3, sliding_window=48), [48, 48, 48]),
    (LlamaConfig(**LAYERS3), [0, 0, 0]),
], ids=["mistral", "mistral-without", "qwen2", "qwen2-unused", "qwen3", "mixtral", "llama"])
def test_each_layer_gets_the_window_transformers_gives_it(config, windows):
    assert layer_windows(config) == windows


WINDOW = 16
WINDOWED = MistralConfig(**TINY, sliding_window=WINDOW)
WINDOW_PROMPT = "Sliding-window attention lets each token see only the last few tokens before it, so that"


def test_a_windowed_model_matches_transformers_far_past_its_window(checkpoint, tokenizer, tmp_path):
    """A prompt three windows long, prefilled in chunks smaller than the window and after a cached
    page, then decoded past it: every position's logits are transformers'."""
    folder = write_checkpoint(tmp_path / "model", WINDOWED, checkpoint)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = load_paged_llama(folder, "float32", "cpu")
    prompt = tokenizer(WINDOW_PROMPT)["input_ids"]
    assert len(prompt) > 1 + WINDOW
    pool = allocate_local_pool(model.kv_layout(8, 16), "cpu")[0]
    pages = list(range(pages_for(len(prompt) + 24, 16)))
    model.prefill(prompt[:16], pool, pages, chunk_tokens=5)  # the cached first page
    logits = [model.prefill(prompt, pool, pages, chunk_tokens=5, start=16)]
    tokens = [int(logits[-1].argmax())]
    for step in range(24):
        position = torch.tensor([len(prompt) + step])
        logits.append(model.decode(torch.tensor(tokens[-1:]), position, torch.tensor([pages]), pool)[0])
        tokens.append(int(logits[-1].argmax()))
    with torch.no_grad():
        expected = reference(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    torch.testing.assert_close(torch.stack(logits), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.e2e
def test_a_windowed_model_is_served_as_transformers_generates_it(checkpoint, tokenizer, tmp_path):
    """Through the stack, one by one and batched in the decode, far past the window. The decode's
    pool holds 4 pages of 16 tokens: a request holds only the 2 its window of 16 spans (a ring over
    its positions), so the two run side by side, and one of 150 tokens is served where 4 pages
    could not hold it whole."""
    folder = write_checkpoint(tmp_path / "model", WINDOWED, checkpoint)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [tokenizer(text)["input_ids"] for text in (WINDOW_PROMPT, "The three primary colors are")]
    expected = [reference_greedy(reference, ids, 40) for ids in prompts]
    longest = reference_greedy(reference, prompts[0], 150 - len(prompts[0]))
    with ServiceStack(tmp_path, CACHE_DIR, PDSERVE_MODEL_PATH=str(folder), PDSERVE_KV_DECODE_PAGES="4") as stack:
        def generate(ids, max_tokens=40):
            request = generation_pb2.GenerateRequest(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0)
            return [t for chunk in stack.stub.Generate(request, timeout=120) for t in chunk.token_ids]

        for ids, (tokens, logits) in zip(prompts, expected):
            assert_matches_reference(generate(ids), tokens, logits, f"windowed prompt of {len(ids)}")
        with ThreadPoolExecutor(len(prompts)) as pool:
            for ids, got, (tokens, logits) in zip(prompts, pool.map(generate, prompts), expected):
                assert_matches_reference(got, tokens, logits, f"windowed concurrent prompt of {len(ids)}")
        assert len(prompts[0]) + len(longest[0]) > 4 * 16
        assert_matches_reference(generate(prompts[0], 150 - len(prompts[0])), *longest, "past the decode's pool")
        stack.stop_drained()


# ---- sampling defaults ----

def test_generation_config_gives_the_sampling_defaults(checkpoint, tmp_path):
    folder = write_checkpoint(tmp_path / "model", LlamaConfig(**TINY), checkpoint,
                              {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True})
    assert sampling_defaults(folder) == SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "bos_token_id": 1}))
    assert sampling_defaults(folder) == SamplingDefaults(temperature=0.3, top_p=1.0, top_k=0)


def test_without_generation_config_openais_defaults_hold(checkpoint):
    """The embedded GGUF's conversion has no generation_config.json."""
    assert not (Path(checkpoint) / "generation_config.json").exists()
    assert sampling_defaults(checkpoint) == SamplingDefaults(temperature=1.0, top_p=1.0, top_k=0)


@pytest.mark.parametrize("generation, message", [
    ({"temperature": -1}, "temperature must be a number >= 0"),
    ({"top_p": 0}, "top_p must be a number in"),
    ({"top_k": 2.5}, "top_k must be an integer >= 0"),
    ({"top_k": True}, "top_k must be an integer >= 0"),
    ([0.7], "is not a JSON object"),
], ids=["temperature", "top_p", "top_k", "bool", "not-an-object"])
def test_a_generation_config_no_request_could_give_is_refused(generation, message, checkpoint, tmp_path):
    folder = write_checkpoint(tmp_path / "model", LlamaConfig(**TINY), checkpoint, generation)
    with pytest.raises(UnsupportedModel, match=message):
        sampling_defaults(folder)


@pytest.mark.e2e
def test_the_router_samples_unset_fields_by_the_models_generation_config(checkpoint, tmp_path):
    """The real router on a tiny checkpoint whose generation_config.json asks for greedy decoding: a
    request without temperature reaches the prefill greedy, one that gives it keeps its own."""
    folder = write_checkpoint(tmp_path / "model", LlamaConfig(**TINY), checkpoint, {"temperature": 0.0, "top_k": 20})
    stack = ServiceStack(tmp_path, CACHE_DIR, services=("router",), PDSERVE_MODEL_PATH=str(folder))
    fingerprint = model_fingerprint(folder, "float32", "none", 1, 1, 16, 16, "bfloat16")
    endpoint = f"ipc://{tmp_path}/run/router.ipc"
    prefill, decode = (ProtocolPeer(endpoint, f"{role}-0", role, fingerprint) for role in (Role.PREFILL, Role.DECODE))
    try:
        for peer in (prefill, decode):
            peer.register()  # queued until the router binds
        with stack, ThreadPoolExecutor(1) as pool:
            for peer in (prefill, decode):
                peer.epoch = peer.receive(Registered).router_epoch
            sampled = []
            for request in (generation_pb2.GenerateRequest(prompt="Hello", max_tokens=1),
                            generation_pb2.GenerateRequest(prompt="Hello", max_tokens=1, temperature=0.7)):
                call = pool.submit(lambda r=request: list(stack.stub.Generate(r, timeout=60)))
                task = prefill.receive(PrefillTask)
                sampled.append(task.sampling)
                prefill.send(KvReady(task.request_id, "prefill-0", wire.pack_page_ids([0]),
                                     len(wire.unpack_token_ids(task.prompt_token_ids)), 42, FinishReason.LENGTH, 0.0, 0))
                assert prefill.receive(ReleaseKv).request_id == task.request_id
                assert [t for chunk in call.result(timeout=30) for t in chunk.token_ids] == [42]
    finally:
        for peer in (prefill, decode):
            peer.close()
    assert [(s.temperature, s.top_p, s.top_k) for s in sampled] == [(0.0, 1.0, 20), (pytest.approx(0.7), 1.0, 20)]
