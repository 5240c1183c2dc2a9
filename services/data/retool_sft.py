"""ReTool-SFT raw traces → multi-turn chat messages (``<code>``-tag or hermes tool-call format).

The published file (JoeYing/ReTool-SFT) has a ``messages`` column: a user message whose text
holds the problem after ``*user question:*`` and one assistant message whose text is the
whole trace: reasoning, ``<code>…</code>``, ``<interpreter>…</interpreter>`` (repeated), and
a final ``<answer>…</answer>``. Files with ``problem``/``solution`` columns are accepted too.

Invariant: a trace is converted only if its tags are balanced, unnested and in order
(code → interpreter, repeated, then answer); anything else is reported and skipped.
Every message has the keys ``role``, ``content``, ``tool_calls`` (null unless a hermes call).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from services.data.io import PrepReport, columns_of, iter_rows, write_rows

Format = Literal["code", "hermes"]
QUESTION_MARKER = "*user question:*"
_TAG = re.compile(r"<(/?)(code|interpreter|answer)>")
_FENCE = re.compile(r"```(?:python|py)?\s*\n?(.*?)```", re.S)


class TraceError(ValueError):
    pass


def split_trace(trace: str) -> list[tuple[str, str]]:
    """Split a trace into ``("text"|"code"|"interpreter"|"answer", content)`` segments, checked."""
    segments: list[tuple[str, str]] = []
    pos = 0
    open_tag: str | None = None
    expected_next = {
        None: {"code", "answer"},
        "code": {"interpreter"},
        "interpreter": {"code", "answer"},
        "answer": set(),
    }
    last_block: str | None = None
    for m in _TAG.finditer(trace):
        closing, name = m.group(1) == "/", m.group(2)
        if not closing:
            if open_tag is not None:
                raise TraceError(f"<{name}> opened inside <{open_tag}>")
            if name not in expected_next[last_block]:
                raise TraceError(f"<{name}> out of order after {last_block or 'start'}")
            if trace[pos : m.start()].strip():
                segments.append(("text", trace[pos : m.start()]))
            open_tag, pos = name, m.end()
        else:
            if open_tag != name:
                raise TraceError(f"</{name}> without matching <{name}>")
            segments.append((name, trace[pos : m.start()]))
            open_tag, last_block, pos = None, name, m.end()
    if open_tag is not None:
        raise TraceError(f"<{open_tag}> never closed")
    if last_block == "code":
        raise TraceError("<code> block without an <interpreter> result")
    if last_block != "answer":
        raise TraceError("trace does not end with an <answer>")
    if trace[pos:].strip():
        segments.append(("text", trace[pos:]))
    return segments


def extract_code(block: str) -> str:
    fenced = _FENCE.search(block)
    return (fenced.group(1) if fenced else block).strip()


def _msg(role: str, content: str, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"role": role, "content": content, "tool_calls": tool_calls}


def to_messages(problem: str, trace: str, fmt: Format) -> list[dict[str, Any]]:
    """Messages for one sample: user, then alternating assistant / tool turns."""
    messages = [_msg("user", problem.strip())]
    text = ""
    for kind, content in split_trace(trace):
        if kind == "text":
            text += content
        elif kind == "code":
            code = extract_code(content)
            if fmt == "code":
                messages.append(_msg("assistant", f"{text}<code>\n```python\n{code}\n```\n</code>".strip()))
            else:
                call = {
                    "type": "function",
                    "function": {"name": "code_interpreter", "arguments": json.dumps({"code": code})},
                }
                messages.append(_msg("assistant", text.strip(), [call]))
            text = ""
        elif kind == "interpreter":
            messages.append(_msg("tool", content.strip()))
        else:  # answer
            text += f"<answer>{content}</answer>" if fmt == "code" else content
    messages.append(_msg("assistant", text.strip()))
    return messages


def _problem_and_trace(row: dict[str, Any]) -> tuple[str, str]:
    if "messages" in row and row["messages"] is not None:
        msgs = row["messages"]
        user = next((m["content"] for m in msgs if m.get("role") == "user"), None)
        trace = next((m["content"] for m in msgs if m.get("role") == "assistant"), None)
        if user is None or trace is None:
            raise TraceError("messages: need a user and an assistant message")
        i = user.find(QUESTION_MARKER)
        problem = user[i + len(QUESTION_MARKER) :] if i >= 0 else user
        return problem.replace("<answer>", "").replace("</answer>", "").strip(), trace
    problem = row.get("problem") or row.get("question")
    trace = row.get("solution") or row.get("response")
    if not problem or not trace:
        raise TraceError("row has neither 'messages' nor 'problem'+'solution'")
    return problem.strip(), trace


def prepare_retool_sft(
    input_path: str | Path, output_path: str | Path, *, fmt: Format = "code", limit: int | None = None
) -> PrepReport:
    cols = set(columns_of(input_path))
    if "messages" not in cols and not ({"problem", "question"} & cols and {"solution", "response"} & cols):
        raise ValueError(
            f"{input_path}: expected a 'messages' column (ReTool-SFT) or 'problem'+'solution' "
            f"columns; found {sorted(cols)}"
        )
    report = PrepReport(input=str(input_path), output=str(output_path))
    out: list[dict[str, Any]] = []
    for index, row in iter_rows(input_path):
        report.rows_read += 1
        try:
            problem, trace = _problem_and_trace(row)
            messages = to_messages(problem, trace, fmt)
        except TraceError as exc:
            report.add_bad(index, str(exc))
            continue
        out.append(
            {
                "messages": messages,
                "format": fmt,
                "num_tool_calls": sum(m["role"] == "tool" for m in messages),
                "source_row": index,
            }
        )
        if limit is not None and len(out) >= limit:
            break
    write_rows(output_path, out)
    report.rows_written = len(out)
    return report
