"""Test-only fault injection: a broken multi-turn layout, to show that the tests guard it.

``RETOOL_FAULT_MULTITURN_MASK`` (unset in any real run) names the bug to reproduce on every
trajectory the trainer trains on:
- ``second_turn``: loss mask 0 on every token after the first interpreter block, so nothing the
  model writes after reading a tool result is trained (masks that lose later turns);
- ``misaligned``: after the first interpreter block the mask is shifted back by that block's
  length, so the tool's tokens are trained and as many of the model's later tokens are not (a
  mask built for a different tokenization of the tool output);
- ``drop_separator``: the first token of every interpreter block is removed, so the trained token
  sequence is not the one that was sampled (verl #6501: the turn separator dropped at each tool
  boundary).
Invariant: with the variable unset (or empty) ``break_layout`` returns its inputs unchanged (the
same objects: lists or the feed's numpy arrays, no copy); an unknown value is refused, naming the
accepted ones.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

FAULT_MULTITURN_MASK = "RETOOL_FAULT_MULTITURN_MASK"
MODES = ("second_turn", "misaligned", "drop_separator")


def mode() -> str | None:
    value = os.environ.get(FAULT_MULTITURN_MASK) or None
    if value is not None and value not in MODES:
        raise ValueError(f"{FAULT_MULTITURN_MASK}={value!r}: expected one of {MODES}")
    return value


def break_layout(ids: Sequence[int], mask: Sequence[int], logprobs: Sequence[float] | None,
                 fault: str | None) -> tuple[Sequence[int], Sequence[int], Sequence[float] | None]:
    if fault is None:
        return ids, mask, logprobs
    ids, mask = np.asarray(ids).tolist(), np.asarray(mask).tolist()
    lps = None if logprobs is None else np.asarray(logprobs).tolist()
    if 0 not in mask:
        return ids, mask, lps
    first_tool = mask.index(0)
    if fault == "second_turn":
        after = next((i for i in range(first_tool, len(mask)) if mask[i] == 1), len(mask))
        return ids, mask[:after] + [0] * (len(mask) - after), lps
    if fault == "misaligned":
        block = next((i for i in range(first_tool, len(mask)) if mask[i] == 1), len(mask)) - first_tool
        return ids, mask[:first_tool] + mask[first_tool + block:] + [0] * block, lps
    keep = [i for i in range(len(ids)) if not (mask[i] == 0 and (i == 0 or mask[i - 1] == 1))]
    return [ids[i] for i in keep], [mask[i] for i in keep], None if lps is None else [lps[i] for i in keep]
