"""Incremental detokenization of one choice, holding back text that may not be shown yet.

``IncrementalText.add(ids)`` returns the text that became final (the decode of a window of recent
tokens, diffed against the same window without the new ones, so a tokenizer that changes a
token's text by what precedes it, or a character split over several byte tokens, is handled);
``HeldText`` releases only what can no longer turn out to be part of a stop string or of a
``<tool_call>`` (which goes into ``tool_calls``, not ``content``).

Invariant: the concatenation of everything ``HeldText.release`` returns, plus ``HeldText.rest``
at the end, is the final content of the choice.
"""

from __future__ import annotations

from services.rollout.agent.loop import Tokenizer

REPLACEMENT = "\ufffd"  # an incomplete UTF-8 sequence decodes to this


class IncrementalText:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text is already in ``text``

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            delta = after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of the choice: whatever is left, incomplete characters included."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        delta = after[len(before) :]
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta


class HeldText:
    """Content released as it becomes safe; ``markers`` are texts that must never be half-shown."""

    def __init__(self, markers: list[str]) -> None:
        self.markers = [m for m in markers if m]
        self.text = ""
        self.released = 0
        self._longest = max((len(m) for m in self.markers), default=0)

    def release(self, delta: str) -> str:
        self.text += delta
        cut = len(self.text)
        start = max(0, self.released - self._longest)
        for m in self.markers:
            at = self.text.find(m, start)
            if at >= 0:
                cut = min(cut, at)
            # a suffix of the text that could be the start of the marker
            for k in range(min(len(m) - 1, len(self.text)), 0, -1):
                if self.text.endswith(m[:k]):
                    cut = min(cut, len(self.text) - k)
                    break
        if cut <= self.released:
            return ""
        out = self.text[self.released : cut]
        self.released = cut
        return out

    def rest(self, content: str) -> str:
        """The part of the final ``content`` not released yet (``content`` starts with what was)."""
        return content[self.released :]
