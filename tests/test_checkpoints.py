"""What a checkpoint tells the stack beside its weights: a sliding window it cannot serve (refused at
load, naming the setting), and the sampling defaults of its generation_config.json (taken by the
router for the fields a request leaves unset). Each checkpoint is a tiny random one that the test
writes with transformers, the embedded model's tokenizer beside it."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from pdserve.v1 import generation_pb2
from shared.control import wire
from shared.control.messages import EXIT_REFUSED, FinishReason, KvReady, PrefillTask, Registered, ReleaseKv, Role
from shared.model.fingerprint import model_fingerprint
from shared.model.generation_config import SamplingDefaults, sampling_defaults
from shared.model.loader import UnsupportedModel, load_hf_config
from tests.conftest import CACHE_DIR
from tests.protocol_peer import ProtocolPeer
from tests.stack import ServiceStack

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=49152, max_position_embeddings=256)  # the embedded tokenizer's vocabulary


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

@pytest.mark.parametrize("config, setting", [
    (MistralConfig(**TINY, sliding_window=48), "sets sliding_window = 48"),
    (Qwen2Config(**TINY, use_sliding_window=True, sliding_window=48),
     "sets use_sliding_window = true, sliding_window = 48"),
], ids=["mistral", "qwen2"])
def test_a_sliding_window_is_refused_naming_the_setting(config, setting, checkpoint, tmp_path):
    folder = write_checkpoint(tmp_path / "model", config, checkpoint)
    with pytest.raises(UnsupportedModel, match=setting) as refused:
        load_hf_config(folder)
    assert refused.value.exit_code == EXIT_REFUSED


@pytest.mark.parametrize("config", [
    MistralConfig(**TINY, sliding_window=None),
    MistralConfig(**TINY, sliding_window=TINY["max_position_embeddings"]),  # never leaves a token out
    Qwen2Config(**TINY, use_sliding_window=False, sliding_window=48),
], ids=["mistral-without", "mistral-window-of-the-context", "qwen2-unused"])
def test_a_checkpoint_whose_attention_sees_every_token_loads(config, checkpoint, tmp_path):
    assert load_hf_config(write_checkpoint(tmp_path / "model", config, checkpoint)).model_type == config.model_type


@pytest.mark.e2e
def test_a_worker_given_a_sliding_window_exits_refused_at_load(checkpoint, tmp_path):
    """Not restarted into the same refusal: the supervisor and systemd leave EXIT_REFUSED alone."""
    folder = write_checkpoint(tmp_path / "model", MistralConfig(**TINY, sliding_window=48), checkpoint)
    stack = ServiceStack(tmp_path, CACHE_DIR, services=("prefill",), PDSERVE_MODEL_PATH=str(folder))
    try:
        stack.start("prefill")
        assert stack.processes["prefill"].wait(timeout=120) == EXIT_REFUSED
        assert "sliding_window = 48" in stack.log_path("prefill").read_text()
    finally:
        stack.stop()


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
                                     len(task.prompt_token_ids), 42, FinishReason.LENGTH, 0.0, 0))
                assert prefill.receive(ReleaseKv).request_id == task.request_id
                assert [t for chunk in call.result(timeout=30) for t in chunk.token_ids] == [42]
    finally:
        for peer in (prefill, decode):
            peer.close()
    assert [(s.temperature, s.top_p, s.top_k) for s in sampled] == [(0.0, 1.0, 20), (pytest.approx(0.7), 1.0, 20)]
