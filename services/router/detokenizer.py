"""Incremental detokenization with stop strings, one per request.

tokenizers' DecodeStream turns ids into text without splitting a multi-byte character (it
returns nothing until the character is complete). Stop strings: the text that could still be
the start of a stop string is held back, so no chunk ever shows part of a stop string.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalText:
    def __init__(self, tokenizer, stop: list[str]):
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._pending = ""  # decoded, not yet emitted

    def push(self, token_id: int) -> tuple[str, bool]:
        """Returns (text to emit now, whether a stop string ended the text)."""
        piece = self._stream.step(self._backend, token_id)
        self._pending += piece or ""
        if self._stop:
            cut = min((i for i in (self._pending.find(s) for s in self._stop) if i >= 0), default=-1)
            if cut >= 0:
                text, self._pending = self._pending[:cut], ""
                return text, True
        keep = min(self._hold, len(self._pending))
        text = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(text):]
        return text, False

    def flush(self) -> str:
        """The held-back tail, once the request has finished without a stop string."""
        text, self._pending = self._pending, ""
        return text
