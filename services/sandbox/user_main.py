"""Run the model's code the way ``python main.py`` would, inside an already-sandboxed process.

Invariants:
- what the code sees matches a fresh interpreter running a script: ``__name__ ==
  "__main__"``, ``sys.argv == ["main.py"]``, stdio set up as CPython sets it for pipes
  (stdout block-buffered, stderr line-buffered, same error handlers), uncaught exceptions
  go through ``sys.excepthook``, ``SystemExit`` codes, non-daemon threads joined, then
  ``atexit`` handlers, then the standard streams flushed (exit code 120 if that fails),
  an uncaught ``KeyboardInterrupt`` ends the process by SIGINT — while the preloaded
  modules are already in ``sys.modules``;
- nothing the code does to ``os``, ``sys``, ``builtins``, ``atexit``, ``threading``,
  ``signal`` or its streams changes how the run ends: every function and class used
  after the code starts is bound to a local of ``run_user_code`` beforehand;
- tracebacks show the code's own frames only, never a frame or path of the sandbox.

``run_user_code`` returns the exit code; the caller ends the process with a ``_exit`` it
captured before calling.
"""

from __future__ import annotations

import atexit
import builtins
import io
import linecache
import os
import random
import signal
import sys
import threading
import traceback
import types

BASE_PATH = "/usr/local/bin:/usr/bin:/bin"
RUN_ENV = {  # the whole environment a run sees (plus HOME; PATH starts with the runtime's bin)
    "PATH": BASE_PATH,
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "TMPDIR": "/tmp",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
    "MPLCONFIGDIR": "/tmp/.matplotlib",  # a run importing matplotlib cold writes its caches there
}
# the interpreter's own code for "flushing stdout failed at exit" (Py_RunMain)
FLUSH_FAILED_EXIT = 120


def run_env(workdir: str) -> dict[str, str]:
    """Environment of a run: ``RUN_ENV``, ``HOME``, and the runtime's bin first on ``PATH``."""
    bin_dir = os.path.dirname(sys.executable)
    return {**RUN_ENV, "HOME": workdir, "PATH": f"{bin_dir}:{BASE_PATH}"}


def _fresh_stdio() -> tuple[io.TextIOWrapper, io.TextIOWrapper]:
    """CPython's standard streams for pipes under a UTF-8 C locale; returns (stdout, stderr)."""
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8",
                                 errors="surrogateescape")
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                  encoding="utf-8", errors="surrogateescape")
    sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                  encoding="utf-8", errors="backslashreplace", line_buffering=True)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    return sys.stdout, sys.stderr


def _reseed() -> None:
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def _prepare_process(workdir: str, filename: str, source: str) -> types.ModuleType:
    want = run_env(workdir)
    for key in [k for k in os.environ if k not in want]:
        del os.environ[key]
    for key, value in want.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGALRM):
        signal.signal(sig, signal.SIG_DFL)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # as CPython sets them at startup
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _reseed()
    sys.argv = [filename]
    sys.path[0:1] = [workdir]
    main = types.ModuleType("__main__")
    main.__file__ = filename
    main.__builtins__ = builtins
    main.__cached__ = None
    sys.modules["__main__"] = main
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    return main


def run_user_code(source: str, workdir: str, filename: str) -> int:
    # --- everything used once the code has started, bound before it starts -------------------
    sys_mod, os_kill, os_getpid, set_signal = sys, os.kill, os.getpid, signal.signal
    sigint, sig_dfl = signal.SIGINT, signal.SIG_DFL
    join_threads = threading._shutdown  # type: ignore[attr-defined]  # what interpreter exit does
    run_exitfuncs = atexit._run_exitfuncs
    default_hook, print_exception = sys.__excepthook__, traceback.print_exception
    base_exc, sys_exit_exc, kbd_exc = BaseException, SystemExit, KeyboardInterrupt
    is_instance, to_str, get_attr, type_of = isinstance, str, getattr, type
    none_type, int_type, bool_type = type(None), int, bool
    main = _prepare_process(workdir, filename, source)
    out, err = _fresh_stdio()

    def write_err(text: str) -> None:
        try:
            stream = get_attr(sys_mod, "stderr", None)
            (stream if stream is not None else err).write(text)
        except base_exc:  # noqa: BLE001 - a broken stderr swallows the message, as in CPython
            pass

    def exit_code(exc: BaseException) -> int:
        code = exc.code  # type: ignore[attr-defined]
        if is_instance(code, none_type):
            return 0
        if is_instance(code, int_type) and not is_instance(code, bool_type):
            return code & 0xFF
        write_err(to_str(code) + "\n")  # sys.exit("message"): printed, exit code 1
        return 1

    def report(exc: BaseException) -> None:
        """The interpreter's report of an uncaught exception, without the sandbox's frame."""
        tb = exc.__traceback__
        tb = tb.tb_next if tb is not None else None
        exc.__traceback__ = tb  # the hook prints the exception's own traceback
        hook = get_attr(sys_mod, "excepthook", None)
        if hook is None or hook is default_hook:  # the same report, with source lines from linecache
            print_exception(type_of(exc), exc, tb, file=get_attr(sys_mod, "stderr", None) or err)
            return
        try:
            hook(type_of(exc), exc, tb)
        except base_exc as hook_exc:  # noqa: BLE001
            write_err("Error in sys.excepthook:\n")
            hook_tb = hook_exc.__traceback__.tb_next if hook_exc.__traceback__ is not None else None
            hook_exc.__traceback__ = hook_tb  # without report()'s own frame
            default_hook(type_of(hook_exc), hook_exc, hook_tb)
            write_err("\nOriginal exception was:\n")
            default_hook(type_of(exc), exc, tb)

    code, by_sigint = 0, False
    try:
        exec(compile(source, filename, "exec"), main.__dict__)
    except sys_exit_exc as exc:
        code = exit_code(exc)
    except base_exc as exc:  # noqa: BLE001 - reported like the interpreter would
        try:  # noqa: SIM105 - contextlib.suppress looks builtins up when it exits
            report(exc)
        except base_exc:  # noqa: BLE001
            pass
        code, by_sigint = 1, is_instance(exc, kbd_exc)
    for finish in (join_threads, run_exitfuncs):
        try:
            finish()
        except sys_exit_exc as exc:
            code = exit_code(exc)
        except base_exc as exc:  # noqa: BLE001
            try:  # noqa: SIM105
                report(exc)
            except base_exc:  # noqa: BLE001
                pass
    for name in ("stdout", "stderr"):  # what Py_FinalizeEx flushes: the current sys.std*
        stream = get_attr(sys_mod, name, None)
        try:
            if stream is not None and not get_attr(stream, "closed", False):
                stream.flush()
        except base_exc:  # noqa: BLE001
            code = FLUSH_FAILED_EXIT
    for stream in (out, err):  # the originals, if the code replaced them (their finalizers would)
        try:  # noqa: SIM105
            stream.flush()
        except base_exc:  # noqa: BLE001
            pass
    if by_sigint:
        try:  # noqa: SIM105
            set_signal(sigint, sig_dfl)
            os_kill(os_getpid(), sigint)
        except base_exc:  # noqa: BLE001
            pass
    return code
