"""Find the final answer in a model response.

Recognised forms, the last one in the response wins: ``<answer>…</answer>`` (with an inner
``\\boxed{}`` taken out), ``\\boxed{…}`` / ``\\fbox{…}`` with nested braces, a line
``Answer: …`` (DAPO's format; any case, optional ``**``, optional ``$…$``; when the line is
empty, the next non-empty line) and "the final answer is …". Text inside ``<code>``,
``<interpreter>``, ``<tool_call>`` and ``<tool_response>`` blocks is ignored: it is the
tool's, not the model's, answer. Chat template markers (``<|im_end|>``) end a line, they are
never part of an answer.

One answer in several parts is one answer: boxes (or ``$…$`` spans of an answer line) that
follow each other with nothing but separators between them (spaces, commas, ``and``/``or``,
``\\quad``, math delimiters, a ``\\text{ for part (a) and }``) are joined with commas:
``\\boxed{(2,2)} \\quad\\text{and}\\quad
\\boxed{(6,2)}`` → ``(2,2), (6,2)``; a short label right before a joined box is kept
(``y_1 = \\boxed{a}`` and ``y_2 = \\boxed{b}`` → ``y_1 = a, y_2 = b``). Words between
boxes end the group: "I first got \\boxed{3} but then \\boxed{5}" answers 5. In an answer
line with words around math (``Answer: The area is $12$.``) the math is the answer, when
it is one group and no number stands outside it; otherwise a prose line answers with the value
it states (``prose``: "The largest $n$ is 34." → 34, "it is $3$, not $4$" → 3).

Invariant: extraction is linear in the response length (no per-match rescans, no
backtracking regex over a line, only the last candidate of each form is ever read out),
because it runs inline in the service's event loop.
"""

from __future__ import annotations

import bisect
import itertools
import re

from services.reward import prose

_TOOL_BLOCKS = re.compile(r"<(code|interpreter|tool_call|tool_response)>.*?(</\1>|$)", re.S)
_ANSWER_HEAD = re.compile(r"\banswer[ \t*_]*[:：][ \t*_]*", re.I)
_FINAL_IS = re.compile(r"final answer is", re.I)
_HOPE = "i hope it is correct"
_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_CHAT_MARKERS = re.compile(r"<\|[a-z_]+\|>")  # <|im_end|>, <|endoftext|>: chat-template tokens
_BARE_TOKEN = re.compile(r"[^\s$]+")
_BRACES = re.compile(r"[{}]")
# What may stand between two parts of one answer (matched on the whole gap, which is short
# or rejected by the length check first).
_CONNECTOR = re.compile(
    r"(?:\s|[,;&.]|\$|\\[()\[\]]|\\q?quad|\\[,;:! ]|~|\\\\|\band\b|\bor\b"
    r"|\\(?:text|textnormal|mbox|mathrm)\s*\{\s*(?:,|and|or|,\s*and)?\s*\}"
    r"|\\(?:text|textnormal|mbox|mathrm)\s*\{\s*,?\s*for\s+part\s+\(?[a-z0-9]\)?\s*,?\s*(?:and)?\s*\})*",
    re.I,
)
_MAX_GAP = 80
_MAX_PARTS = 64  # more parts than this is no answer (and far over max_answer_chars anyway)
_MAX_DISPLAY = 2000  # how far an answer line's display math may run on
_GAP_LABEL = re.compile(
    r"(?<![A-Za-z\\])(?:[A-Za-z]|\\[a-z]+)(?:_\{?[A-Za-z0-9]+\}?)?(?:\([A-Za-z0-9]\))?\s*=\s*$"
    r"|\([A-Za-z](?:\s*,\s*[A-Za-z])+\)\s*=\s*$"
)
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]")


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


Span = tuple[int, int, str]  # (start, end, content)


def boxed_spans(text: str) -> list[Span]:
    """(start, end, content) of every complete ``\\boxed{…}``/``\\fbox{…}`` (or ``\\boxed 5``)."""
    out = []
    pairs: dict[int, int] | None = None
    for m in _BOX.finditer(text):
        j = m.end()
        if j < len(text) and text[j] == "{":
            if pairs is None:
                pairs = _brace_pairs(text, j)  # braces before the first box never matter
            end = pairs.get(j)
            if end is not None:
                out.append((m.start(), end + 1, text[j + 1 : end]))
        else:
            token = _BARE_TOKEN.match(text, j)
            if token:
                out.append((m.start(), token.end(), token.group(0)))
    return out


def _connects(gap: str | None) -> bool:
    return gap is not None and len(gap) <= _MAX_GAP and _CONNECTOR.fullmatch(gap) is not None


def _gap(text: str, before: Span, after: Span) -> str | None:
    """The separator text between two spans, a label of the later one left out, or None."""
    gap = text[before[1] : after[0]]
    if len(gap) > 2 * _MAX_GAP:
        return None
    label = _GAP_LABEL.search(gap)
    return gap[: label.start()] if label else gap


def _label_before(text: str, lo: int, span: Span) -> str:
    m = _GAP_LABEL.search(text[max(lo, span[0] - _MAX_GAP) : span[0]])
    return m.group(0) if m else ""


def _group(text: str, spans: list[Span], leading: bool) -> tuple[int, int]:
    """Index range of the last (with ``leading``, the first) group joined by separators only."""
    i = j = 0 if leading else len(spans) - 1
    if leading:
        while j + 1 < len(spans) and j < _MAX_PARTS and _connects(_gap(text, spans[j], spans[j + 1])):
            j += 1
    else:
        while i > 0 and j - i < _MAX_PARTS and _connects(_gap(text, spans[i - 1], spans[i])):
            i -= 1
    return i, j


def join_parts(text: str, spans: list[Span], *, leading: bool = False) -> str:
    """The last (with ``leading``, the first) group of spans with only separators between.

    Joined with ", "; a group of identical parts is that part once. In a group of several,
    a short label right before a part (``y_1 =``) is kept with it.
    """
    if not spans:
        return ""
    i, j = _group(text, spans, leading)
    contents = [span[2] for span in spans[i : j + 1]]
    if len(set(contents)) == 1:
        return contents[0]
    parts = []
    for k in range(i, j + 1):
        lo = spans[k - 1][1] if k > 0 else 0
        parts.append(_label_before(text, lo, spans[k]) + spans[k][2])
    return ", ".join(parts)


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


def _line_end(text: str, start: int) -> int:
    end = text.find("\n", start)
    return end if end != -1 else len(text)


def _rest_of_line(text: str, start: int) -> str:
    return text[start : _line_end(text, start)].rstrip(" \t\r")


def _answer_line(text: str, start: int) -> str:
    """The rest of the line after ``Answer:``, or the next non-empty line when it is empty;
    display math opened on it runs on to its close."""
    line = _rest_of_line(text, start)
    if not line.strip():
        nxt = _line_end(text, start) + 1
        while nxt < len(text) and text[nxt].isspace():
            nxt += 1
        if nxt >= len(text) or _ANSWER_HEAD.match(text, nxt):
            return ""
        start, line = nxt, _rest_of_line(text, nxt)
    return _with_display_math(text, start, line)


def _final_is(text: str, start: int) -> str:
    """Minerva's "The final answer is …": the rest of the line (the next line if that is empty),
    up to "I hope it is correct" wherever that stands."""
    while start < len(text) and (text[start] == ":" or text[start].isspace()):
        start += 1
    line = _rest_of_line(text, start)
    hope = line.lower().find(_HOPE)
    return line[:hope].rstrip() if hope != -1 else line


def _with_display_math(text: str, line_start: int, line: str) -> str:
    """A line that opens ``\\[`` or ``$$`` and closes it on a later line: through the close."""
    for left, right in (("\\[", "\\]"), ("$$", "$$")):
        opened = line.rfind(left)
        if opened != -1 and line.find(right, opened + len(left)) == -1:
            close = text.find(right, line_start + len(line), line_start + len(line) + _MAX_DISPLAY)
            if close != -1:
                return " ".join(text[line_start : close + len(right)].split())
    return line


def _prose_or(line: str) -> str:
    """The value a prose line states (``prose``'s rules), else the line as written."""
    if not prose.is_prose(line):
        return line
    return prose.stated_value(line) or line


def _from_line(line: str) -> str:
    """An answer line's answer: its boxes, else its math when words surround it, else itself."""
    boxes = boxed_spans(line)
    if boxes:
        return join_parts(line, boxes)
    found = itertools.islice(_MATH_SPAN.finditer(line), _MAX_PARTS + 1)
    spans = [(m.start(), m.end(), next(g for g in m.groups() if g)) for m in found]
    if not spans or len(spans) > _MAX_PARTS:
        return _prose_or(line)
    before, after = line[: spans[0][0]].strip(), line[spans[-1][1] :].strip(" .")
    if not before and not after and len(spans) == 1:
        return line  # "$17$": the delimiters go later
    if any(ch.isdigit() for ch in _MATH_SPAN.sub(" ", line)):
        return _prose_or(line)  # "The largest $n$ is 34": numbers outside the math
    if _group(line, spans, leading=not before) != (0, len(spans) - 1):
        return _prose_or(line)  # "it is $3$, not $4$": words between the math
    return join_parts(line, spans, leading=not before)


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
    if tags:
        start, _, inner = tags[-1]
        boxes = boxed_spans(inner)
        candidates.append((start, join_parts(inner, boxes) if boxes else inner))
    tag_starts = [t[0] for t in tags]
    outside = []
    for span in boxed_spans(text):
        k = bisect.bisect_right(tag_starts, span[0]) - 1  # tags never overlap: only the last start counts
        if k < 0 or span[0] >= tags[k][1]:
            outside.append(span)
    if outside:
        candidates.append((outside[-1][0], join_parts(text, outside)))
    for start, end in reversed(_matches(text, _ANSWER_HEAD, "answer")):
        line = _answer_line(text, end)
        if line:
            candidates.append((start, _from_line(line)))
            break
    for start, end in reversed(_matches(text, _FINAL_IS, "final answer is")):
        line = _final_is(text, end)
        if line:
            candidates.append((start, _from_line(line)))
            break
    if not candidates:
        return None
    answer = _strip_math(max(candidates, key=lambda c: c[0])[1])
    return answer or None
