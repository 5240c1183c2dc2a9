"""A warm fork server: preloads the usual modules once, then forks one process per run and
supervises all its runs from one event loop (``runner``), and holds live sessions (``session_runner``).

Runs on the runs' own interpreter (``runtime_python``), started by the service with a
scrubbed environment (so no secret is in its memory or in ``/proc/<pid>/environ`` of
anything forked from it). Invariants: the zygote is single-threaded (so it forks from a
known state and can move between pid namespaces), never runs model code itself, waits for
every process it starts, and dies with the service — the parent-death signal plus a check
against the service's pid passed on the command line, which stays right when the service
is pid 1 (as in a container). Its runs die with it (their parent-death signal).

Usage: ``python -m services.sandbox.zygote --socket PATH --parent-pid PID --preload math,numpy``
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import json
import os
import resource
import signal
import socket
import struct
import sys

from services.sandbox import linux, runner, session_runner
from services.sandbox.protocol import MAX_FRAME, RunOutcome, RunSpec, pack, unpack_body
from services.sandbox.run_process import keep_tmp_runtime
from services.sandbox.runner import create_slot_netns, remember_own_pid_namespace
from services.sandbox.runtime_view import expose_runtime, remount_readonly, runtime_paths

THREAD_STACK_BYTES = 8 * 1024 * 1024


def _warm_up() -> None:
    """Exercise lazily initialised code paths so forked runs find them ready."""
    sp = sys.modules.get("sympy")
    if sp is not None:
        x = sp.symbols("x")
        sp.solve(x**2 - 2, x)
        sp.simplify(sp.sin(x) ** 2 + sp.cos(x) ** 2)
        sp.factorint(360)
        sp.isprime(97)
        sp.integrate(x**2, x)
        sp.Matrix([[1, 2], [3, 4]]).det()
        sp.nsimplify(0.5)
        sp.Rational(1, 3) + sp.sqrt(8)
    np = sys.modules.get("numpy")
    if np is not None:
        np.linalg.inv(np.eye(3))
        np.random.rand(3)
    optimize = sys.modules.get("scipy.optimize")
    if optimize is not None:
        optimize.brentq(lambda t: t * t - 2, 0, 2)
    pd = sys.modules.get("pandas")
    if pd is not None:
        pd.DataFrame({"a": [1, 2], "b": [3, 4]}).groupby("a").sum()
    nx = sys.modules.get("networkx")
    if nx is not None:
        nx.shortest_path(nx.path_graph(4), 0, 3)


def preload(modules: list[str]) -> list[str]:
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a missing optional module is not fatal
            failed.append(name)
            print(f"zygote: cannot preload {name}: {exc}", file=sys.stderr)
    _warm_up()
    return failed


def bind(sock_path: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    listener.bind(sock_path)
    os.umask(old_umask)
    listener.listen(4096)
    return listener


def serve(listener: socket.socket, ready: dict[str, object]) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # each run waits for its own processes
    gc.collect()
    gc.freeze()  # keep GC from touching (and un-sharing) the warm heap in every child
    sys.stdout.write("READY " + json.dumps(ready) + "\n")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)
    os.close(devnull)
    loop = asyncio.new_event_loop()  # not asyncio.run: no SIGINT handler of its own
    loop.run_until_complete(_serve(listener))


async def _serve(listener: socket.socket) -> None:
    server = await asyncio.start_unix_server(_handle, sock=listener, backlog=4096)
    await server.serve_forever()


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One request in, one outcome out; any failure here is the sandbox's (SandboxError)."""
    try:
        (length,) = struct.unpack(">I", await reader.readexactly(4))
        if length > MAX_FRAME:
            raise ValueError(f"frame of {length} bytes exceeds {MAX_FRAME}")
        outcome = await _dispatch(unpack_body(await reader.readexactly(length)))
    except Exception as exc:  # noqa: BLE001
        outcome = RunOutcome(ok=False, error=f"{type(exc).__name__}: {exc}")
    try:
        writer.write(pack(outcome))
        await writer.drain()
    except OSError:
        pass  # the service gave up on this run
    finally:
        writer.close()


async def _dispatch(msg: dict[str, object]) -> RunOutcome:
    """A run (a ``RunSpec`` map), or a session operation (``op``: open, cell, close)."""
    op = msg.pop("op", None)
    if op is None:
        return await runner.execute(RunSpec(**msg))  # type: ignore[arg-type]
    sid = str(msg["id"])
    if op == "session_open":
        return await session_runner.open_session(sid, RunSpec(**msg["spec"]))  # type: ignore[arg-type]
    if op == "session_cell":
        return await session_runner.run_cell(sid, msg)
    if op == "session_close":
        return await session_runner.close_session(sid)
    raise ValueError(f"unknown operation {op!r}")


def _ensure_stack_room(stack_mb: int) -> None:
    """Re-exec with ``RLIMIT_STACK`` >= ``stack_mb`` (as far as the hard limit allows).

    The kernel places the memory map below the stack at exec time, leaving as much room as
    the stack limit then allows; a run (forked from us) may later raise its stack limit only
    within that room. Threads keep glibc's usual 8 MB default stacks.
    """
    want = stack_mb * 1024 * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_STACK, (target, hard))
        os.execv(sys.executable, sys.orig_argv)
    linux.set_default_thread_stack(THREAD_STACK_BYTES)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--parent-pid", type=int, required=True, help="the service's pid, as we see it")
    parser.add_argument("--preload", default="")
    parser.add_argument("--stack-mb", type=int, default=0, help="largest stack a run may get")
    parser.add_argument("--writable", default="", help="mount points runners must write (cgroups)")
    parser.add_argument("--netns-slots", default="", help="slots to create a network namespace for")
    args = parser.parse_args(argv)
    if args.stack_mb:
        _ensure_stack_room(args.stack_mb)
    linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != args.parent_pid:  # the service died before we set the death signal
        sys.exit(1)
    listener = bind(args.socket)  # before the filesystem view turns read-only
    package_dir = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # .../services
    paths = runtime_paths(package_dir)
    expose_runtime(paths)
    # every run's mount namespace is a copy of this read-only view
    remount_readonly(frozenset(m for m in args.writable.split(",") if m))
    # each run's tmpfs at /tmp would hide these (also as reached through symlinks)
    keep_tmp_runtime([*paths, sys.prefix, os.path.dirname(sys.executable)])
    remember_own_pid_namespace()
    failed = preload([m for m in args.preload.split(",") if m])
    create_slot_netns([int(s) for s in args.netns_slots.split(",") if s])
    serve(listener, {"python": sys.executable, "version": sys.version.split()[0], "preload_failed": failed})


if __name__ == "__main__":
    main()
