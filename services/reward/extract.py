"""Find the final answer in a model response.

Recognised forms, the last one in the response wins: ``<answer>…</answer>`` (with an inner
``\\boxed{}`` taken out), ``\\boxed{…}`` / ``\\fbox{…}`` with nested braces, a line
``Answer: …`` (DAPO's format; any case, optional ``**``, optional ``$…$``) and "the final
answer is …". Text inside ``<code>``, ``<interpreter>``, ``<tool_call>`` and
``<tool_response>`` blocks is ignored: it is the tool's, not the model's, answer. Chat
template markers (``<|im_end|>``) end a line, they are never part of an answer.
"""

from __future__ import annotations

import re

_TOOL_BLOCKS = re.compile(r"<(code|interpreter|tool_call|tool_response)>.*?(</\1>|$)", re.S)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_ANSWER_LINE = re.compile(r"\banswer[ \t*_]*[:：][ \t*_]*(.+?)[ \t]*$", re.I | re.M)
_FINAL_IS = re.compile(r"final answer is[:\s]*(.+?)(?:\.?\s*I hope it is correct\.?)?\s*$", re.I | re.M)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_CHAT_MARKERS = re.compile(r"<\|[a-z_]+\|>")  # <|im_end|>, <|endoftext|>: chat-template tokens


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """Content of the brace group opening at ``text[start] == '{'`` and the index after it."""
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
    return None


def boxed_spans(text: str) -> list[tuple[int, str]]:
    """(position, content) of every complete ``\\boxed{…}``/``\\fbox{…}`` (or ``\\boxed 5``)."""
    out = []
    for m in _BOX.finditer(text):
        j = m.end()
        if j < len(text) and text[j] == "{":
            got = _braced(text, j)
            if got is not None:
                out.append((m.start(), got[0]))
        else:
            token = re.match(r"[^\s$]+", text[j:])
            if token:
                out.append((m.start(), token.group(0)))
    return out


def _strip_math(s: str) -> str:
    s = s.strip().rstrip(".").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
            s = s[len(left) : len(s) - len(right)].strip()
    return s


def extract_answer(response: str) -> str | None:
    text = _TOOL_BLOCKS.sub(" ", _CHAT_MARKERS.sub("\n", response))
    candidates: list[tuple[int, str]] = []
    for m in _ANSWER_TAG.finditer(text):
        inner = m.group(1)
        boxes = boxed_spans(inner)
        candidates.append((m.start(), boxes[-1][1] if boxes else inner))
    tag_spans = [(m.start(), m.end()) for m in _ANSWER_TAG.finditer(text)]
    for pos, content in boxed_spans(text):
        if not any(a <= pos < b for a, b in tag_spans):
            candidates.append((pos, content))
    for m in _ANSWER_LINE.finditer(text):
        line = m.group(1)
        boxes = boxed_spans(line)
        candidates.append((m.start(), boxes[-1][1] if boxes else line))
    for m in _FINAL_IS.finditer(text):
        candidates.append((m.start(), m.group(1)))
    if not candidates:
        return None
    answer = _strip_math(max(candidates, key=lambda c: c[0])[1])
    return answer or None
