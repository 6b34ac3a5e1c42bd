"""transformers as the reference: its greedy tokens, and a comparison that allows for its ties."""

from __future__ import annotations

import torch

TIE = 1e-3  # a batched step may flip a token only where the reference's top two logits are this close


def reference_greedy(model, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and the logits it chose them from."""
    ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt_ids):].tolist(), [step[0] for step in out.logits]


def assert_matches_reference(got: list[int], expected: list[int], logits: list[torch.Tensor], what: str,
                             tie: float = TIE) -> None:
    """Equal tokens, except that after a tie in the reference (top two logits closer than `tie`)
    the two runs may go separate ways."""
    for i, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            top2 = logits[i].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < tie, f"{what}: token {i} is {a}, transformers chose {b} with a logit margin of {gap}"
            return
    assert len(got) == len(expected), f"{what}: {len(got)} tokens, transformers made {len(expected)}"
