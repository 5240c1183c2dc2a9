"""Incremental stop-string detection on decoded text.

Invariant: ``match`` is called after every generated token; it returns the stop string whose
first occurrence in the decoded generation ends earliest, as soon as the token that completes it
has been generated (even if the stop string ends in the middle of that token). Because it runs
after every token, only a window of recent tokens needs decoding: an occurrence lying entirely in
older tokens would already have stopped generation.
"""

from __future__ import annotations

from typing import Any


class StopMatcher:
    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._decode = _decoder(tokenizer)
        # a character is at most 4 byte-level tokens; +2 for a partial character at either end
        self.window = 4 * max((len(s) for s in self.stops), default=0) + 2

    def match(self, generated: list[int]) -> str | None:
        if not self.stops:
            return None
        text = self._decode(generated[-self.window:])
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0 and (best is None or at + len(stop) < best[0]):
                best = (at + len(stop), stop)
        return best[1] if best else None


def _decoder(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer directly: no Python post-processing per call
        return lambda ids: backend.decode(ids, skip_special_tokens=False)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
