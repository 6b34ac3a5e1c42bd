"""services/router/detokenizer.py with the embedded model's real tokenizer: multi-byte characters
never split, special tokens silent, stop strings cut the text and never leak a prefix."""

import pytest

from services.router.detokenizer import IncrementalText

TEXTS = [
    "Café crème brûlée à la française, s'il vous plaît.",
    "日本語のテキストです。東京は大きい。",
    "I love 🦀 and 👩‍👩‍👧 emoji! 🎉🎉",
    "Mixed: naïve façade — 東京 🚀 done.\nNew line\ttab.",
]


@pytest.fixture(scope="session")
def tok(tokenizer):
    """transformers' tokenizer (tests/conftest.py), for its decode(): the reference text."""
    return tokenizer


def push_all(detok: IncrementalText, ids: list[int]) -> tuple[list[str], bool]:
    """Every chunk up to and including the push that reports a stop string; whether one did."""
    chunks = []
    for token_id in ids:
        text, stopped = detok.push(token_id)
        chunks.append(text)
        if stopped:
            return chunks, True
    return chunks, False


@pytest.mark.parametrize("text", TEXTS)
def test_chunks_concatenate_to_the_decoded_text(tok, text):
    ids = tok(text)["input_ids"]
    chunks, stopped = push_all(IncrementalText(tok, []), ids)
    assert not stopped
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in chunk for chunk in chunks)


def test_multi_byte_characters_span_several_tokens(tok):
    """Guards the test above: the texts do split characters across tokens for this tokenizer."""
    ids = tok("🦀")["input_ids"]
    assert len(ids) > 1
    assert "\ufffd" in tok.decode(ids[:1])


def test_special_tokens_produce_no_text(tok):
    special = [tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")]
    assert len(set(special)) == 3
    detok = IncrementalText(tok, [])
    assert [detok.push(t) for t in special] == [("", False)] * 3
    assert detok.flush() == ""


def test_chat_template_ids_drop_the_special_tokens(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "Où est l'hôtel? 🏨"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert set(ids) & set(tok.all_special_ids)
    chunks, _ = push_all(IncrementalText(tok, []), ids)
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=True)
    assert "<|im_start|>" not in "".join(chunks) and "Où est l'hôtel? 🏨" in "".join(chunks)


@pytest.mark.parametrize(("text", "stops"), [
    ("The answer is 42. END of answer, more text here.", ["END"]),
    ("Bonjour, ça va? Très bien, merci. ### la suite", ["###"]),
    ("Liste: un, deux, trois. Fin de liste.", ["trois.", "deux"]),  # the earlier occurrence wins
    ("Go 🚀 to the moon 🌕 and beyond", ["🌕"]),
    ("abc\n\nUser: hello", ["\n\nUser:", "zzzzzzzzzzzzzzzzzzzz"]),  # a long stop string raises the hold
])
def test_stop_string_cuts_the_text(tok, text, stops):
    ids = tok(text)["input_ids"]
    chunks, stopped = push_all(IncrementalText(tok, stops), ids)
    assert stopped
    first = min(i for i in (text.find(s) for s in stops) if i >= 0)
    assert "".join(chunks) == text[:first]
    assert not any("\ufffd" in chunk for chunk in chunks)


@pytest.mark.parametrize(("text", "stop"), [
    ("Say STOP now and then more", "STOP"),
    ("x = 1 <|end|> trailing", "<|end|>"),
    ("Le café est très chaud. FIN.", "é est très"),
])
def test_no_chunk_shows_a_prefix_of_the_stop_string(tok, text, stop):
    """Before the stop string completes, the text emitted so far never ends inside it."""
    ids = tok(text)["input_ids"]
    start = text.find(stop)
    detok = IncrementalText(tok, [stop])
    emitted = ""
    for token_id in ids:
        chunk, stopped = detok.push(token_id)
        emitted += chunk
        assert len(emitted) <= start, f"emitted {emitted!r} runs into the stop string {stop!r}"
        if stopped:
            break
    assert stopped and emitted == text[:start]


def test_held_text_is_released_by_flush_when_no_stop_matches(tok):
    text = "We nearly said the EN word, then ENDED without it: EN"
    ids = tok(text)["input_ids"]
    detok = IncrementalText(tok, ["END!", "FINISH"])
    chunks, stopped = push_all(detok, ids)
    assert not stopped
    held = detok.flush()
    assert held and "".join(chunks) != text  # something was held back ...
    assert "".join(chunks) + held == text    # ... and flush gives it back
    assert detok.flush() == ""


def test_a_prefix_that_never_completes_is_released(tok):
    text = "Almost a stop: ST and more words after it."
    ids = tok(text)["input_ids"]
    detok = IncrementalText(tok, ["STOP"])
    chunks, stopped = push_all(detok, ids)
    assert not stopped
    assert "".join(chunks).startswith("Almost a stop: ST and")  # released once it cannot be a stop
    assert "".join(chunks) + detok.flush() == text
