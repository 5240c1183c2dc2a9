"""A warm fork server: preloads the usual modules once, then forks one process per run and
supervises all its runs from one event loop (``runner``), and holds live sessions (``session_runner``).

Runs on the runs' own interpreter (``runtime_python``), started by the service with a
scrubbed environment (so no secret is in its memory or in ``/proc/<pid>/environ`` of
anything forked from it). Invariants: the zygote is single-threaded (so it forks from a
known state and can move between pid namespaces), never runs model code itself, waits for
every process it starts, and dies with the service — the parent-death signal plus a check
against the service's pid passed on the command line, which stays right when the service
is pid 1 (as in a container). Its runs die with it (their parent-death signal).

Start-up order (each step before the one that would make it impossible): bind the socket,
hold the cgroup parents and namespace handles, preload, build the syscall filter, empty the
capability bounding set, enter the runs' minimal root (``rootfs``: from then on no host
path is reachable). Under ``--isolation strict`` a missing filter or bounding-set drop
ends the zygote with ``FAILED <reason>`` instead of ``READY``; the root is never optional.

Usage: ``python -m services.sandbox.zygote --socket PATH --parent-pid PID --root DIR --preload math,numpy``
"""

from __future__ import annotations

import sys

# asyncio imports ssl (and OpenSSL) for TLS the zygote never uses: 1.3 MB of heap every run
# would copy. Hidden while the zygote's modules load, importable again for runs afterwards.
_HIDE_SSL = "ssl" not in sys.modules
if _HIDE_SSL:
    sys.modules["ssl"] = None  # type: ignore[assignment]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402

from services.sandbox import cgroups, linux, rootfs, run_process, runner, session_runner  # noqa: E402
from services.sandbox.phases import PhaseBoard  # noqa: E402
from services.sandbox.protocol import MAX_FRAME, RunOutcome, RunSpec, pack, unpack_body  # noqa: E402
from services.sandbox.run_process import keep_tmp_runtime  # noqa: E402
from services.sandbox.runner import create_slot_netns, remember_own_pid_namespace  # noqa: E402

if _HIDE_SSL:
    del sys.modules["ssl"]

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
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is not None:  # fonts, the Agg renderer and PNG writer, loaded once here

        fig = plt.figure()
        plt.plot([0, 1], [0, 1])
        fig.savefig(io.BytesIO(), format="png", bbox_inches="tight")
        plt.close("all")


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


def _threads() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("Threads:"))


def _harden(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The filter, the root, the bounding set; returns (host paths bound into the root, gaps)."""
    gaps = []
    if args.seccomp_bpf:
        with open(args.seccomp_bpf, "rb") as fh:
            run_process.FILTER = linux.SeccompProgram(fh.read())
    else:
        gaps.append("no syscall filter (the service could not build it; see its log)")
    if _threads() != 1:  # a mount namespace can only be unshared by a single-threaded process
        raise RuntimeError(f"the zygote must be single-threaded before entering its root ({_threads()} "
                           "threads after preloading; set OPENBLAS_NUM_THREADS=1 etc.)")
    stage = os.environ.get("PYTHONPATH", "")
    runtime = rootfs.runtime_paths(exclude=[stage])
    # each run's tmpfs at /tmp would hide these (also as reached through symlinks)
    keep_tmp_runtime([*runtime, sys.prefix, os.path.dirname(sys.executable)])
    try:  # bounds what later execs may gain, not what the zygote holds: it still builds the root
        linux.drop_bounding_set()
    except OSError as exc:
        gaps.append(f"capability bounding set not cleared ({exc}; needs CAP_SETPCAP)")
    os.makedirs(args.root, 0o700, exist_ok=True)
    bound = rootfs.build_and_enter(args.root, runtime, range(args.uid_base, args.uid_base + args.uid_count))
    return bound, gaps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--parent-pid", type=int, required=True, help="the service's pid, as we see it")
    parser.add_argument("--root", required=True, help="empty directory to build the runs' root at")
    parser.add_argument("--preload", default="")
    parser.add_argument("--stack-mb", type=int, default=0, help="largest stack a run may get")
    parser.add_argument("--cgroup-parents", default="", help="directories holding the slot cgroups")
    parser.add_argument("--netns-slots", default="", help="slots to create a network namespace for")
    parser.add_argument("--slot-count", type=int, default=1, help="slot indices this zygote may serve")
    parser.add_argument("--uid-base", type=int, default=61000)
    parser.add_argument("--uid-count", type=int, default=1)
    parser.add_argument("--isolation", choices=("strict", "degraded"), default="strict")
    parser.add_argument("--seccomp-bpf", default="", help="the runs' syscall filter (syscall_filter.export)")
    args = parser.parse_args(argv)
    if args.stack_mb:
        _ensure_stack_room(args.stack_mb)
    linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # no Python handler for init children to inherit
    if os.getppid() != args.parent_pid:  # the service died before we set the death signal
        sys.exit(1)
    listener = bind(args.socket)  # before the root changes
    cgroups.hold([p for p in args.cgroup_parents.split(",") if p])
    remember_own_pid_namespace()  # runs return to it after each fork (see runner._start)
    runner.BOARD = PhaseBoard(args.slot_count)
    failed = preload([m for m in args.preload.split(",") if m])
    create_slot_netns([int(s) for s in args.netns_slots.split(",") if s])
    try:
        bound, gaps = _harden(args)
    except Exception as exc:  # noqa: BLE001 - reported to the service, which refuses to start
        gaps, bound = [f"the runs' root could not be built ({type(exc).__name__}: {exc})"], []
        args.isolation = "strict"
    if gaps and args.isolation == "strict":
        sys.stdout.write("FAILED " + json.dumps({"gaps": gaps}) + "\n")
        sys.stdout.flush()
        sys.exit(3)
    serve(listener, {"python": sys.executable, "version": sys.version.split()[0], "preload_failed": failed,
                     "isolation_gaps": gaps, "root": bound})


if __name__ == "__main__":
    main()
