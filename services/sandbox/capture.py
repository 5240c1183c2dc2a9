"""A run's output: capped capture (zygote side) and decoding into the response (service side).

Invariants:
- at most ``cap`` bytes of a stream are kept (its head and tail), never the whole stream;
  what is dropped is counted and marked in place;
- a cut never splits a UTF-8 character, so truncation alone never makes output undecodable;
- decoding follows SandboxFusion: a stream that is not valid UTF-8 is replaced by
  ``[DecodeError] <reason>`` (its clients already know that marker).
"""

from __future__ import annotations

_CONT_MASK, _CONT = 0xC0, 0x80  # UTF-8 continuation bytes are 10xxxxxx


def _whole_chars_end(data: bytes | bytearray) -> int:
    """Length of ``data`` without a trailing, incomplete UTF-8 sequence."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        lead = data[n - back]
        if lead & _CONT_MASK != _CONT:
            need = 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
            return n if back >= need else n - back
    return n


def _whole_chars_start(data: bytes | bytearray) -> int:
    """Index of the first byte of ``data`` that is not the continuation of a cut character."""
    for i in range(min(3, len(data))):
        if data[i] & _CONT_MASK != _CONT:
            return i
    return min(3, len(data))


class CappedBuffer:
    """Keeps the first and last ``cap // 2`` bytes of a stream and counts what is dropped."""

    def __init__(self, cap: int) -> None:
        self.head_cap = cap - cap // 2
        self.tail_cap = cap // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data and self.tail_cap:
            self.tail += data
            if len(self.tail) > self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]

    @property
    def dropped(self) -> int:
        return self.total - len(self.head) - len(self.tail)

    def render(self) -> bytes:
        if self.dropped == 0:
            return bytes(self.head + self.tail)
        head = bytes(self.head[:_whole_chars_end(self.head)])
        tail = bytes(self.tail[_whole_chars_start(self.tail):])
        omitted = self.total - len(head) - len(tail)
        return head + f"\n...[output truncated: {omitted} bytes omitted]...\n".encode() + tail


def decode_output(data: bytes) -> str:
    """SandboxFusion's decoding of a captured stream."""
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        return f"[DecodeError] {exc}"
