"""The router's tokenizer, without torch: the checkpoint's tokenizer.json run by `tokenizers`, and
its chat template rendered by jinja2.

transformers' AutoTokenizer imports torch whenever torch is installed, and even its torch-free
chat-template module loads numpy and huggingface_hub, in a process whose budget is 150 MB resident
(docs/BENCHMARKS.md, the router's memory). So the router reads the same files itself. The ids equal AutoTokenizer's
(tests/test_tokenizer.py): tokenizer.json's post-processor adds the special tokens a plain prompt
gets, and a rendered chat is encoded without them, as apply_chat_template does. Templates run in
jinja2's immutable sandbox with the options and helpers Hugging Face chat templates are written
for (trim_blocks, lstrip_blocks, loop controls, tojson without HTML escaping, raise_exception,
strftime_now).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache
from pathlib import Path

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, models, pre_tokenizers

from shared.model import presets

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ServingTokenizer:
    def __init__(self, backend: Tokenizer, special_tokens: dict[str, str], chat_template: str | None):
        self.backend_tokenizer = backend
        self.special_tokens = special_tokens
        self.chat_template = chat_template

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self.backend_tokenizer.token_to_id(eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch lets go of the GIL while it works; encode holds it, so a long prompt encoded in
        # a thread would stall the router's event loop as much as one encoded on it.
        return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The chat as its template renders it, the assistant's turn opened: the text encode_chat encodes."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a prompt instead of messages")
        return _compiled(self.chat_template).render(messages=messages, add_generation_prompt=True,
                                                    **self.special_tokens)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def load_tokenizer(checkpoint: Path | str) -> ServingTokenizer:
    """checkpoint: a folder with tokenizer.json, or a `random:<preset>` name."""
    if presets.is_random(str(checkpoint)):
        return synthetic_tokenizer(presets.preset_fields(str(checkpoint)))
    folder = Path(checkpoint)
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"{folder} has no tokenizer.json: pdserve needs a fast (Rust) tokenizer")
    settings = _read_json(folder / "tokenizer_config.json")
    special = {**_read_json(folder / "special_tokens_map.json"), **settings}
    template = folder / "chat_template.jinja"
    chat_template = template.read_text() if template.is_file() else settings.get("chat_template")
    return ServingTokenizer(Tokenizer.from_file(str(folder / "tokenizer.json")),
                            {name: _token_text(special[name]) for name in SPECIAL_TOKEN_NAMES
                             if special.get(name) is not None},
                            chat_template)


def synthetic_tokenizer(preset: dict) -> ServingTokenizer:
    """A word-level tokenizer whose token i is the word `<i>`, for random-weight models: the router
    can then tokenize and detokenize their ids like any other model's."""
    backend = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(preset["vocab_size"])}, unk_token="<0>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return ServingTokenizer(backend, {"eos_token": f"<{preset['eos_token_id']}>",
                                      "bos_token": f"<{preset['bos_token_id']}>", "unk_token": "<0>"}, None)


@cache
def _compiled(chat_template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env.from_string(chat_template)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)  # a template's own refusal, e.g. roles out of order


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken's fields."""
    return token["content"] if isinstance(token, dict) else str(token)
