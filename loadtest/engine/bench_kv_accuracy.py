"""Accuracy of the quantized KV caches, and of FP8 weights, against the unquantized model (JSON on stdout).

    python -m loadtest.engine.bench_kv_accuracy [--model embedded] [--device cpu] [--tokens 64] [--fp8-weights]
                                                [--out FILE]

The reference runs every prompt with kv.dtype "bfloat16": pages unquantized, in the model's own
dtype (float32 for the CPU's embedded model), and generates --tokens greedy tokens. Each quantized
format (float8_e4m3, int8) then runs the same prompts twice:
- teacher-forced, fed the reference's tokens so that every step has the reference's context: per
  step, whether its greedy token is the reference's (token agreement) and the mean and max
  absolute difference of its logits from the reference's (step 0 is the prefill's logits);
- free-running, on its own greedy tokens: how many match the reference's before the first that
  differs, and how many prompts give the reference's whole sequence.
The reference's margin between its top two logits (quantiles over every step of every prompt)
says how close its greedy choices are: where they are closer than the quantized logits move, a
token may flip (a random-weight model's margins are far below a trained model's).
The prompts run batched through PagedLlama.prefill and .decode, as a prefill and a decode worker
run them (on a GPU: the fused RoPE/KV write and the Triton paged attention, without CUDA graphs).
A checkpoint's prompts are a fixed set of texts; a random-weight model's (random:...) are seeded
random token ids, --prompt-tokens each.
With --fp8-weights the model's linear layers are then quantized (model.quantization fp8,
shared/model/quantization.py) and run the same way, with unquantized pages ("fp8 weights") and
with float8_e4m3 pages ("fp8 weights, float8_e4m3"), against the same unquantized reference.
On a GPU, float8_e4m3 runs a second time with the FP8-query attention (PagedLlama.fp8_query), as
"float8_e4m3+fp8_query"; with --baseline (a file of an earlier shared/kernels/paged_attention_triton.py,
loadtest/lib/baseline_attention.py) each format also runs with that kernel, as "<format>+baseline".
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass

import torch

from loadtest.lib import baseline_attention
from loadtest.lib.model_costs import kv_token_bytes
from loadtest.lib.report import emit
from shared.kv.pages import pages_for
from shared.kv.pool import allocate_local_pool
from shared.model import presets
from shared.model.from_checkpoint import load_paged_llama
from shared.model.llama import PagedLlama
from shared.model.loader import resolve_checkpoint
from shared.model.tokenizer import load_tokenizer

PAGE_SIZE = 16
QUANTIZED = ("float8_e4m3", "int8")
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    "Les fleurs du jardin sont très belles et",
    "Photosynthesis is the process by which plants",
    "Here is a short list of the planets of the solar system, in order from the Sun:",
    "Question: A train leaves at 3 pm and travels 120 km at 60 km/h. When does it arrive?\nAnswer:",
    "In 1969, the Apollo 11 mission",
]
CHATS = [
    [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}],
    [{"role": "system", "content": "You are a helpful assistant who writes Python."},
     {"role": "user", "content": "Write a function that checks whether a string is a palindrome."}],
]


@dataclass
class Run:
    tokens: torch.Tensor        # [prompts, steps] the greedy token of each step
    logits: list[torch.Tensor]  # per step [prompts, vocab], float32


def prompts_for(model_path: str, checkpoint, vocab_size: int, count: int, length: int) -> list[list[int]]:
    if presets.is_random(model_path):
        generator = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for _ in range(count)]
    tokenizer = load_tokenizer(checkpoint)
    texts = [tokenizer.encode(text) for text in TEXTS]
    chats = [tokenizer.encode_chat(chat) for chat in CHATS]
    return (texts + chats)[:count]


@torch.inference_mode()
def generate(model: PagedLlama, prompts: list[list[int]], kv_dtype: str, steps: int,
             forced: torch.Tensor | None = None) -> Run:
    """Greedy decoding of every prompt in one batch, with pages in kv_dtype; `forced` [prompts,
    steps]: the tokens to feed instead of the run's own."""
    pages_each = [pages_for(len(ids) + steps, PAGE_SIZE) for ids in prompts]
    pool, _buffer = allocate_local_pool(model.kv_layout(sum(pages_each), PAGE_SIZE, kv_dtype), model.device)
    starts = [sum(pages_each[:i]) for i in range(len(prompts))]
    table = torch.zeros((len(prompts), max(pages_each)), dtype=torch.long)
    for row, (start, count) in enumerate(zip(starts, pages_each)):
        table[row, :count] = torch.arange(start, start + count)
    logits = [torch.stack([model.prefill(ids, pool, list(range(start, start + count)))
                           for ids, start, count in zip(prompts, starts, pages_each)])]
    tokens = [logits[0].argmax(-1)]
    positions = torch.tensor([len(ids) for ids in prompts], device=model.device)
    table = table.to(model.device)
    for step in range(1, steps):
        fed = tokens[-1] if forced is None else forced[:, step - 1]
        logits.append(model.decode(fed, positions + step - 1, table, pool).float())
        tokens.append(logits[-1].argmax(-1))
    return Run(torch.stack(tokens, dim=1), logits)


def compare(reference: Run, forced: Run, free: Run) -> dict:
    per_step = []
    for step, (ref, ours) in enumerate(zip(reference.logits, forced.logits)):
        diff = (ours - ref).abs()
        per_step.append({"step": step,
                         "token_agreement": (forced.tokens[:, step] == reference.tokens[:, step]).float().mean().item(),
                         "mean_abs_logit_diff": diff.mean().item(), "max_abs_logit_diff": diff.max().item()})
    differs = free.tokens != reference.tokens
    prefix = [int(row.nonzero()[0]) if row.any() else len(row) for row in differs.cpu()]
    return {
        "token_agreement": (forced.tokens == reference.tokens).float().mean().item(),
        "mean_abs_logit_diff": sum(s["mean_abs_logit_diff"] for s in per_step) / len(per_step),
        "max_abs_logit_diff": max(s["max_abs_logit_diff"] for s in per_step),
        "free_running": {"identical_sequences": sum(p == len(differs[0]) for p in prefix),
                         "tokens_before_first_difference": prefix},
        "per_step": per_step,
    }


def variants(device: str, baseline) -> list[tuple[str, str, bool, contextlib.AbstractContextManager]]:
    """(name, kv.dtype, fp8_query, the attention kernel in place) of each quantized run."""
    out = [(kv_dtype, kv_dtype, False, contextlib.nullcontext()) for kv_dtype in QUANTIZED]
    if device != "cpu":
        out.append(("float8_e4m3+fp8_query", "float8_e4m3", True, contextlib.nullcontext()))
        if baseline is not None:
            out += [(f"{kv_dtype}+baseline", kv_dtype, False, baseline_attention.in_the_model(baseline))
                    for kv_dtype in QUANTIZED]
    return out


def top2_margins(run: Run) -> dict:
    top2 = torch.stack(run.logits).topk(2, dim=-1).values
    margins = (top2[..., 0] - top2[..., 1]).flatten().cpu()
    return {f"p{q}": margins.quantile(q / 100).item() for q in (10, 50, 90)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.engine.bench_kv_accuracy")
    parser.add_argument("--model", default="embedded", help="a checkpoint, 'embedded', or random:<preset>")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="the model's dtype; default float32 on the CPU, else bfloat16")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--prompts", type=int, default=len(TEXTS) + len(CHATS))
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="length of a random-weight model's prompts")
    parser.add_argument("--cache-dir", default="~/.cache/pdserve")
    parser.add_argument("--baseline", help="GPU: a file of an earlier shared/kernels/paged_attention_triton.py")
    parser.add_argument("--fp8-weights", action="store_true", help="also run with the weights in FP8")
    parser.add_argument("--out")
    args = parser.parse_args()
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    checkpoint = resolve_checkpoint(args.model, args.cache_dir)
    model = load_paged_llama(checkpoint, dtype, args.device)
    prompts = prompts_for(args.model, checkpoint, model.vocab_size, args.prompts, args.prompt_tokens)
    reference = generate(model, prompts, "bfloat16", args.tokens)
    reference_bytes = kv_token_bytes(model, "bfloat16", PAGE_SIZE)
    report = {
        "model": args.model, "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "torch": torch.__version__, "dtype": dtype, "tokens": args.tokens,
        "prompt_tokens": [len(ids) for ids in prompts],
        "reference": f"kv.dtype bfloat16: unquantized {dtype} pages, {reference_bytes} bytes/token",
        "reference_top2_margin": top2_margins(reference),
        "formats": {},
    }
    baseline = baseline_attention.load(args.baseline) if args.baseline else None
    for name, kv_dtype, fp8_query, kernel in variants(args.device, baseline):
        model.fp8_query = fp8_query
        with kernel:
            forced = generate(model, prompts, kv_dtype, args.tokens, forced=reference.tokens)
            free = generate(model, prompts, kv_dtype, args.tokens)
        report["formats"][name] = {"kv_bytes_per_token": kv_token_bytes(model, kv_dtype, PAGE_SIZE),
                                   **compare(reference, forced, free)}
    if args.fp8_weights:
        model.fp8_query = False
        for layer in model.layers:
            layer.quantize_fp8()
        for name, kv_dtype in (("fp8 weights", "bfloat16"), ("fp8 weights, float8_e4m3", "float8_e4m3")):
            forced = generate(model, prompts, kv_dtype, args.tokens, forced=reference.tokens)
            free = generate(model, prompts, kv_dtype, args.tokens)
            report["formats"][name] = {"kv_bytes_per_token": kv_token_bytes(model, kv_dtype, PAGE_SIZE),
                                       **compare(reference, forced, free)}
    emit(report, args.out)


if __name__ == "__main__":
    main()
