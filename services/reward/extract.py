"""Find the final answer in a model response.

Recognised forms, the last one in the response wins: ``<answer>…</answer>`` (with an inner
``\\boxed{}`` taken out), ``\\boxed{…}`` / ``\\fbox{…}`` with nested braces, a line
``Answer: …`` (DAPO's format; any case, optional ``**``, optional ``$…$``) and "the final
answer is …". Text inside ``<code>``, ``<interpreter>``, ``<tool_call>`` and
``<tool_response>`` blocks is ignored: it is the tool's, not the model's, answer. Chat
template markers (``<|im_end|>``) end a line, they are never part of an answer.

Invariant: extraction is linear in the response length (no per-match rescans, no
backtracking regex over a line), because it runs inline in the service's event loop.
"""

from __future__ import annotations

import bisect
import re

_TOOL_BLOCKS = re.compile(r"<(code|interpreter|tool_call|tool_response)>.*?(</\1>|$)", re.S)
_ANSWER_HEAD = re.compile(r"\banswer[ \t*_]*[:：][ \t*_]*", re.I)
_FINAL_IS = re.compile(r"final answer is", re.I)
_HOPE = "i hope it is correct"
_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_CHAT_MARKERS = re.compile(r"<\|[a-z_]+\|>")  # <|im_end|>, <|endoftext|>: chat-template tokens
_BARE_TOKEN = re.compile(r"[^\s$]+")
_BRACES = re.compile(r"[{}]")


def _brace_pairs(text: str, start: int) -> dict[int, int]:
    """Index of the matching ``}`` for every ``{`` that is closed, in one linear pass.

    One pass, not a scan per ``\\boxed``: a response of many unclosed ``\\boxed{`` must not
    cost quadratic time (the fast path runs inline in the service's event loop).
    """
    pairs: dict[int, int] = {}
    stack: list[int] = []
    for m in _BRACES.finditer(text, start):  # the regex engine skips the text between braces
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            pairs[stack.pop()] = m.start()
    return pairs


def boxed_spans(text: str) -> list[tuple[int, str]]:
    """(position, content) of every complete ``\\boxed{…}``/``\\fbox{…}`` (or ``\\boxed 5``)."""
    out = []
    pairs: dict[int, int] | None = None
    for m in _BOX.finditer(text):
        j = m.end()
        if j < len(text) and text[j] == "{":
            if pairs is None:
                pairs = _brace_pairs(text, j)  # braces before the first box never matter
            end = pairs.get(j)
            if end is not None:
                out.append((m.start(), text[j + 1 : end]))
        else:
            token = _BARE_TOKEN.match(text, j)
            if token:
                out.append((m.start(), token.group(0)))
    return out


def _strip_math(s: str) -> str:
    s = s.strip().rstrip(".").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
            s = s[len(left) : len(s) - len(right)].strip()
    return s


def _answer_tags(text: str) -> list[tuple[int, int, str]]:
    """(start, end, inner) of every ``<answer>…</answer>``, found with ``str.find`` in linear time."""
    out = []
    pos = 0
    while (start := text.find("<answer>", pos)) != -1:
        end = text.find("</answer>", start + 8)
        if end == -1:
            break  # no later tag can be closed either
        out.append((start, end + 9, text[start + 8 : end]))
        pos = end + 9
    return out


def _rest_of_line(text: str, start: int) -> str:
    end = text.find("\n", start)
    return text[start : end if end != -1 else len(text)].rstrip(" \t\r")


def _final_is(text: str, start: int) -> str:
    """Minerva's "The final answer is …": the rest of the line (the next line if that is empty)."""
    while start < len(text) and (text[start] == ":" or text[start].isspace()):
        start += 1
    line = _rest_of_line(text, start)
    low = line.lower()
    for suffix in (_HOPE + ".", _HOPE):
        if low.endswith(suffix):
            line = line[: len(line) - len(suffix)].rstrip()
            break
    return line


def _matches(text: str, pattern: re.Pattern[str], word: str) -> list[tuple[int, int]]:
    """Spans of a case-insensitive ``pattern`` that starts with ``word``.

    A case-insensitive regex scan has no literal prefix to jump to and costs ~15 µs per KB;
    on ASCII text ``str.find`` on the lower-cased text finds the few places to try instead.
    """
    if not text.isascii():  # lower() may change lengths outside ASCII: plain scan
        return [m.span() for m in pattern.finditer(text)]
    lower = text.lower()
    out = []
    pos = lower.find(word)
    while pos != -1:
        m = pattern.match(text, pos)
        if m:
            out.append(m.span())
        pos = lower.find(word, pos + 1)
    return out


def extract_answer(response: str) -> str | None:
    """The last final answer in ``response``, or None. Linear time in the response length."""
    text = _TOOL_BLOCKS.sub(" ", _CHAT_MARKERS.sub("\n", response))
    candidates: list[tuple[int, str]] = []
    tags = _answer_tags(text)
    for start, _, inner in tags:
        boxes = boxed_spans(inner)
        candidates.append((start, boxes[-1][1] if boxes else inner))
    tag_starts = [t[0] for t in tags]
    for pos, content in boxed_spans(text):
        k = bisect.bisect_right(tag_starts, pos) - 1  # tags never overlap: only the last start counts
        if k < 0 or pos >= tags[k][1]:
            candidates.append((pos, content))
    for start, end in _matches(text, _ANSWER_HEAD, "answer"):
        line = _rest_of_line(text, end)
        if line:
            boxes = boxed_spans(line)
            candidates.append((start, boxes[-1][1] if boxes else line))
    for start, end in _matches(text, _FINAL_IS, "final answer is"):
        line = _final_is(text, end)
        if line:
            candidates.append((start, line))
    if not candidates:
        return None
    answer = _strip_math(max(candidates, key=lambda c: c[0])[1])
    return answer or None
