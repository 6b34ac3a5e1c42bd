"""shared/model/tokenizer.py, the router's torch-free tokenizer, gives transformers' ids: plain
prompts (with the special tokens tokenizer.json adds), chats through the model's template, and the
synthetic tokenizer of the random presets."""

import subprocess
import sys

import pytest

from shared.model.tokenizer import load_tokenizer

PROMPTS = [
    "Once upon a time, in a small village,",
    "日本語のテキストです。 I love 🦀 and 👩‍👩‍👧 emoji!",
    "  leading spaces\tand tabs\nand new lines  ",
    "<|im_start|>user text that names a special token<|im_end|>",
    "x",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Où est l'hôtel? 🏨"},
     {"role": "assistant", "content": "Ici."}, {"role": "user", "content": "Merci!"}],
]


@pytest.fixture(scope="module")
def serving(checkpoint):
    return load_tokenizer(checkpoint)


@pytest.mark.parametrize("text", PROMPTS)
def test_a_prompt_encodes_as_transformers_does(serving, tokenizer, text):
    assert serving.encode(text) == tokenizer(text)["input_ids"]
    assert serving.encode(text, add_special_tokens=False) == tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("chat", CHATS)
def test_a_chat_encodes_as_apply_chat_template_does(serving, tokenizer, chat):
    expected = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert serving.encode_chat(chat) == expected


def test_eos_is_the_checkpoints(serving, tokenizer):
    assert serving.eos_token_id == tokenizer.eos_token_id is not None


def test_a_preset_tokenizer_maps_word_i_to_id_i_and_has_no_chat_template():
    synthetic = load_tokenizer("random:llama-tiny")
    assert synthetic.encode("<5> <31999> <0>") == [5, 31999, 0]
    assert synthetic.eos_token_id == 2
    with pytest.raises(ValueError, match="no chat template"):
        synthetic.encode_chat(CHATS[0])


@pytest.mark.e2e
def test_loading_and_using_it_imports_no_torch(checkpoint):
    script = (f"import sys; from shared.model.tokenizer import load_tokenizer; t = load_tokenizer({str(checkpoint)!r}); "
              f"t.encode_chat({CHATS[0]!r}); t.encode('hi'); "
              "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
