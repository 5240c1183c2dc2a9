"""A session's live interpreter: runs cell after cell in one ``__main__`` namespace, as a notebook.

Runs inside an already-sandboxed process (``run_process`` did the namespaces, cgroup, uid
drop and limits, exactly as for a stateless run) in place of ``user_main.run_user_code``.
Cells arrive on the cell socket as frames (4-byte big-endian length + msgpack
``{"code", "files"}``); after each cell the standard streams are flushed and one result
frame goes back: ``{"rc", "display", "figures", "error"}``.

Invariants:
- globals persist from cell to cell; an expression on the last line of a cell is evaluated
  and its ``repr`` returned as ``display`` (``None`` is not displayed), as in a notebook;
- every matplotlib figure open at the end of a cell comes back as Jupyter display data
  (``figures.take_figures``: ``image/png`` + ``text/plain``) and is closed, as Jupyter's
  inline backend shows plots; ``plt.show()`` itself shows nothing and warns nothing;
- an exception ends the cell, not the session: the traceback (the cell's own frames only)
  goes to stderr and ``rc`` is 1; ``SystemExit`` gives its code and the session lives on;
- the cell's stdout/stderr are written to fds 1/2 (pipes the zygote reads) before the
  result frame is sent, so everything a cell printed is in the pipes when its result arrives;
- what the loop uses after a cell started is bound to locals first, so a cell that replaces
  ``sys``, ``builtins`` or the streams cannot change how results are framed. A cell may still
  break its own session on purpose; the zygote treats a malformed frame as the session's end.
"""

from __future__ import annotations

import ast
import linecache
import os
import socket
import struct
import sys
import traceback
import warnings
from typing import Any

import msgpack

from services.sandbox.figures import take_figures
from services.sandbox.user_main import _fresh_stdio, _prepare_process

MAX_CELL_FRAME = 16 * 1024 * 1024
MAX_DISPLAY_CHARS = 64 * 1024


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _compile_cell(source: str, filename: str, *, _compile: Any = compile, _is_instance: Any = isinstance,
                  _flags: int = ast.PyCF_ONLY_AST, _expr: Any = ast.Expr,
                  _expression: Any = ast.Expression) -> tuple[Any, Any]:
    """(statements, last-line expression or None), compiled as a notebook cell is; uses only
    what was bound at import, so a cell that replaced builtins still gets its next cells run."""
    tree = _compile(source, filename, "exec", _flags)
    last = None
    if tree.body and _is_instance(tree.body[-1], _expr):
        last = _expression(tree.body.pop().value)
    body = _compile(tree, filename, "exec")
    return body, (_compile(last, filename, "eval") if last is not None else None)


def serve(ctl_fd: int, workdir: str) -> int:
    """The cell loop; returns (the exit code) when the service closes the cell socket."""
    sock = socket.socket(fileno=ctl_fd)
    recv_exact, unpack, pack, be32 = _recv_exact, msgpack.unpackb, msgpack.packb, struct.Struct(">I")
    base_exc, sys_exit_exc, is_instance, to_repr, to_str = BaseException, SystemExit, isinstance, repr, str
    get_attr, type_of, fmt_exc, compile_cell = getattr, type, traceback.format_exception, _compile_cell
    sys_mod, os_write, len_of, line_cache = sys, os.write, len, linecache.cache
    main = _prepare_process(workdir, "cell", "")
    out, err = _fresh_stdio()
    # under Agg, plt.show() would warn that it cannot show: figures are shown after the cell
    warnings.filterwarnings("ignore", message=".*non-interactive, and thus cannot be shown")
    figures_of = take_figures
    namespace = main.__dict__
    number = 0

    def flush_all() -> None:
        for stream in (get_attr(sys_mod, "stdout", None), get_attr(sys_mod, "stderr", None), out, err):
            try:
                if stream is not None:
                    stream.flush()
            except base_exc:  # noqa: BLE001 - a broken stream of the cell's own making
                pass

    def report(exc: BaseException) -> dict[str, Any]:
        tb = exc.__traceback__
        tb = tb.tb_next if tb is not None else None  # drop this loop's own frame
        try:
            lines = fmt_exc(type_of(exc), exc, tb)
        except base_exc:  # noqa: BLE001 - the cell broke what formatting needs: say at least what
            lines = [f"{type_of(exc).__name__}: (traceback unavailable)\n"]
        text = "".join(lines)
        try:
            stream = get_attr(sys_mod, "stderr", None) or err
            stream.write(text)
        except base_exc:  # noqa: BLE001
            try:  # noqa: SIM105 - contextlib.suppress looks builtins up when it exits
                os_write(2, text.encode(errors="backslashreplace"))
            except base_exc:  # noqa: BLE001
                pass
        try:
            value = to_str(exc)
        except base_exc:  # noqa: BLE001
            value = ""
        return {"ename": type_of(exc).__name__, "evalue": value, "traceback": lines}

    while True:
        header = recv_exact(sock, 4)
        if header is None:
            return 0
        (length,) = be32.unpack(header)
        if length > MAX_CELL_FRAME:
            return 2
        body = recv_exact(sock, length)
        if body is None:
            return 0
        msg = unpack(body, raw=False)
        number += 1
        filename = f"cell_{number}.py"
        source = msg["code"]
        rc, display, error = 0, None, None
        try:
            for rel, data in msg.get("files", {}).items():
                path = os.path.join(workdir, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as fh:
                    fh.write(data)
            line_cache[filename] = (len_of(source), None, source.splitlines(True), filename)
            statements, last = compile_cell(source, filename)
            exec(statements, namespace)
            if last is not None:
                value = eval(last, namespace)
                if value is not None:
                    namespace["_"] = value
                    display = to_repr(value)[:MAX_DISPLAY_CHARS]
        except sys_exit_exc as exc:
            code = exc.code
            rc = 0 if code is None else code & 0xFF if is_instance(code, int) else 1
        except base_exc as exc:  # noqa: BLE001 - reported, the session lives on
            try:
                error = report(exc)
            except base_exc:  # noqa: BLE001
                error = {"ename": "Exception", "evalue": "", "traceback": []}
            rc = 1
        figures = figures_of()
        flush_all()
        reply = pack({"rc": rc, "display": display, "figures": figures, "error": error}, use_bin_type=True)
        sock.sendall(be32.pack(len_of(reply)) + reply)
