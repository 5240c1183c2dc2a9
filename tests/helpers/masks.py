"""Reading loss masks in tests."""

from __future__ import annotations


def spans(mask: list[int], value: int = 1) -> list[tuple[int, int]]:
    """The ``[start, end)`` runs of ``mask`` equal to ``value`` (0 or 1), in order."""
    out, start = [], None
    for i, m in enumerate([*mask, 1 - value]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            out.append((start, i))
            start = None
    return out
