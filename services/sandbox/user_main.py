"""Run the model's code the way ``python main.py`` would, inside an already-sandboxed process.

Invariant: behaviour seen by the code matches a fresh interpreter running a script —
``__name__ == "__main__"``, ``sys.argv == ["main.py"]``, tracebacks with source lines,
``SystemExit`` codes, atexit handlers and non-daemon threads honoured — while the
preloaded modules are already in ``sys.modules``. Returns the exit code.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import io
import linecache
import os
import random
import signal
import sys
import threading
import traceback
import types

RUN_ENV = {  # the whole environment a run sees (plus HOME)
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TMPDIR": "/tmp",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
}


def _fresh_stdio() -> None:
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                  encoding="utf-8", errors="backslashreplace")
    sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                  encoding="utf-8", errors="backslashreplace", line_buffering=True)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr


def _reseed() -> None:
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run_user_code(source: str, workdir: str, filename: str) -> int:
    want = {**RUN_ENV, "HOME": workdir}
    for key in [k for k in os.environ if k not in want]:
        del os.environ[key]
    for key, value in want.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGALRM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _fresh_stdio()
    _reseed()
    sys.argv = [filename]
    sys.path[0:1] = [workdir]
    main = types.ModuleType("__main__")
    main.__file__ = filename
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    code = 0
    try:
        exec(compile(source, filename, "exec"), main.__dict__)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:  # noqa: BLE001 - printed like the interpreter would
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        traceback.print_exception(type(exc), exc, tb if not isinstance(exc, SyntaxError) else None)
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads, like exit
        atexit._run_exitfuncs()
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # e.g. closed or broken pipe
            stream.flush()
    return code
