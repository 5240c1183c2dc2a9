"""Whatever model code does to its own interpreter, the run ends as ``python main.py`` would,
and the answer never shows the sandbox's own frames or paths (real server on loopback).

Each probe also checks that the service keeps answering afterwards."""

from __future__ import annotations

import pytest

from tests.integration.sandbox_client import run_code, stderr_of, stdout_of

pytestmark = pytest.mark.integration

# SandboxFusion's anti-cheat header, prepended to submissions in its OJ mode
ANTIHACK = "import os\nimport sys\nexit = None\nos._exit = None\nsys.exit = None\n"
SANDBOX_TRACES = ("services/sandbox", "services.sandbox", "zygote", "runner.py", "user_main",
                  "run_process", "retool-sandbox")


def _run(url: str, code: str, **fields):
    r = run_code(url, code, **fields)
    everything = stdout_of(r) + stderr_of(r) + r["message"]
    leaked = [t for t in SANDBOX_TRACES if t in everything]
    assert not leaked, (leaked, r)
    return r


def _finished(r, status: str, return_code: int) -> None:
    assert r["status"] == status, r
    assert r["run_result"]["status"] == "Finished" and r["run_result"]["return_code"] == return_code, r


@pytest.mark.parametrize("code,out,status,rc", [
    (ANTIHACK + "print('hello')", "hello\n", "Success", 0),
    (ANTIHACK + "print('hello')\nexit(0)", "hello\n", "Failed", 1),  # exit is None: a TypeError
    ("import os\nos._exit = lambda c: None\nprint('hello')", "hello\n", "Success", 0),
    ("import os\nos._exit = lambda c: None\nprint('hello')\nraise SystemExit(4)", "hello\n", "Failed", 4),
    ("import sys\nsys.exit = lambda *a: None\nprint('hello')\nsys.exit(3)", "hello\n", "Success", 0),
    ("import builtins\nbuiltins.SystemExit = None\nbuiltins.BaseException = None\n"
     "builtins.isinstance = None\nprint('hello')", "hello\n", "Success", 0),
    ("import sys, builtins\nprint('hello')\nbuiltins.print = None\nsys.modules.clear()\nraise SystemExit(5)",
     "hello\n", "Failed", 5),
])
def test_replaced_exit_functions_and_builtins_do_not_break_the_end_of_a_run(sandbox_url, code, out,
                                                                             status, rc):
    r = _run(sandbox_url, code)
    _finished(r, status, rc)
    assert stdout_of(r) == out


def test_atexit_handlers_run_after_threads_and_can_set_the_exit_code(sandbox_url):
    code = ("import atexit, sys, threading, time\n"
            "atexit.register(lambda: print('atexit ran', flush=True))\n"
            "t = threading.Thread(target=lambda: (time.sleep(0.2), print('thread ran', flush=True)))\n"
            "t.start()\nprint('main done', flush=True)\n")
    r = _run(sandbox_url, code)
    _finished(r, "Success", 0)
    assert stdout_of(r) == "main done\nthread ran\natexit ran\n"
    replaced = _run(sandbox_url, "import atexit\natexit._run_exitfuncs = None\n"
                                 "atexit.register(print, 'still')\n")
    _finished(replaced, "Success", 0)
    assert stdout_of(replaced) == "still\n"


def test_threads_left_running(sandbox_url):
    daemon = ("import threading, time\n"
              "threading.Thread(target=lambda: time.sleep(1000), daemon=True).start()\nprint('done')")
    r = _run(sandbox_url, daemon, run_timeout=10)
    _finished(r, "Success", 0)
    assert stdout_of(r) == "done\n"  # ended, not held until the 10 s limit
    spinning = ("import threading\nthreading.Thread(target=lambda: [0 for _ in iter(int, 1)]).start()\n"
                "print('main done', flush=True)")
    r = _run(sandbox_url, spinning, run_timeout=1)  # a non-daemon thread keeps python alive
    assert r["run_result"]["status"] == "TimeLimitExceeded" and stdout_of(r) == "main done\n"


def test_signal_handlers_and_self_sent_signals(sandbox_url):
    handled = ("import os, signal\nsignal.signal(signal.SIGTERM, lambda *a: print('caught', flush=True))\n"
               "os.kill(os.getpid(), signal.SIGTERM)\nprint('alive')")
    r = _run(sandbox_url, handled)
    _finished(r, "Success", 0)
    assert stdout_of(r) == "caught\nalive\n"
    ignored = ("import signal\n"
               "for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP): signal.signal(s, signal.SIG_IGN)\n")
    r = _run(sandbox_url, ignored + "while True: pass", run_timeout=1)
    assert r["run_result"]["status"] == "TimeLimitExceeded"  # the wall limit does not ask
    for sig, rc in (("SIGKILL", -9), ("SIGTERM", -15)):
        code = (f"import os, signal\nprint('before', flush=True)\nos.kill(os.getpid(), signal.{sig})\n"
                "print('after')")
        r = _run(sandbox_url, code)
        _finished(r, "Failed", rc)  # as SandboxFusion reports a signal death: Finished, -signal
        assert stdout_of(r) == "before\n"
    r = _run(sandbox_url, "raise KeyboardInterrupt")
    _finished(r, "Failed", -2)  # CPython ends an uncaught KeyboardInterrupt by SIGINT
    assert "KeyboardInterrupt" in stderr_of(r)


def test_swapped_and_closed_standard_streams(sandbox_url):
    r = _run(sandbox_url, "import io, sys\nprint('visible')\nsys.stdout = io.StringIO()\nprint('swallowed')")
    _finished(r, "Success", 0)
    assert stdout_of(r) == "visible\n"
    r = _run(sandbox_url, "import io, sys\nsys.stderr = io.StringIO()\n1 / 0")
    _finished(r, "Failed", 1)
    assert stderr_of(r) == ""  # the traceback went to the code's own stderr object
    r = _run(sandbox_url, "import os\nos.close(1)\nos.close(2)\n")
    _finished(r, "Success", 0)
    r = _run(sandbox_url, "import os\nprint('buffered')\nos.close(1)\nos.close(2)\n")
    _finished(r, "Failed", 120)  # CPython: flushing stdout failed at exit
    r = _run(sandbox_url, "import sys\nsys.stdout.close()\nsys.stderr.close()\n")
    _finished(r, "Success", 0)


def test_custom_excepthook_is_used_and_a_failing_one_is_reported(sandbox_url):
    code = ("import sys\n"
            "sys.excepthook = lambda t, v, tb: print('custom hook:', t.__name__, v, file=sys.stderr)\n1 / 0")
    r = _run(sandbox_url, code)
    _finished(r, "Failed", 1)
    assert stderr_of(r) == "custom hook: ZeroDivisionError division by zero\n"
    r = _run(sandbox_url, "import sys\nsys.excepthook = None\nraise ValueError('boom')")
    _finished(r, "Failed", 1)
    assert "ValueError: boom" in stderr_of(r)
    r = _run(sandbox_url, "import sys\ndef hook(*a): raise RuntimeError('hook broke')\n"
                          "sys.excepthook = hook\nraise ValueError('boom')")
    _finished(r, "Failed", 1)
    err = stderr_of(r)
    assert "Error in sys.excepthook" in err and "hook broke" in err and "ValueError: boom" in err


def test_tracebacks_show_only_the_codes_own_frames(sandbox_url):
    r = _run(sandbox_url, "def f(n):\n    return 1 / n\n\nf(0)\n")
    err = stderr_of(r)
    assert err.startswith("Traceback (most recent call last):\n  File \"main.py\", line 4, in <module>\n")
    assert "return 1 / n" in err and err.rstrip().endswith("ZeroDivisionError: division by zero")
    r = _run(sandbox_url, "x = (\n")
    assert stderr_of(r).startswith('  File "main.py", line 1') and "SyntaxError" in stderr_of(r)


def test_deep_recursion_after_raising_the_recursion_limit(sandbox_url):
    """The stack follows the memory limit (SandboxFusion's rule), so DP-style recursion works."""
    code = ("import sys, functools\nsys.setrecursionlimit(10**6)\n@functools.lru_cache(maxsize=None)\n"
            "def f(n):\n    return 0 if n == 0 else f(n - 1) + 1\nprint(f(30000))")
    r = _run(sandbox_url, code, memory_limit_MB=1024)
    _finished(r, "Success", 0)
    assert stdout_of(r) == "30000\n"
    r = _run(sandbox_url, "import resource\nprint(resource.getrlimit(resource.RLIMIT_STACK)[0] // 2**20)",
             memory_limit_MB=512)
    assert stdout_of(r) == "512\n"


def test_invalid_utf8_output_is_marked_like_sandboxfusion(sandbox_url):
    r = _run(sandbox_url, "import sys\nsys.stdout.buffer.write(b'ok\\xff\\n')\n"
                          "print('fine', file=sys.stderr)")
    _finished(r, "Success", 0)
    assert stdout_of(r).startswith("[DecodeError] 'utf-8' codec can't decode byte 0xff")
    assert stderr_of(r) == "fine\n"
    r = _run(sandbox_url, "print('\\udcff')")  # a lone surrogate, written as CPython does for pipes
    assert stdout_of(r).startswith("[DecodeError]")
