"""A warm fork server: preloads the usual modules once, then forks one runner per request.

Started by the service with a scrubbed environment (so no secret is in its memory or in
``/proc/<pid>/environ`` of anything forked from it). Invariant: the zygote is single-
threaded when it forks, never runs model code itself, and dies with the service.

Usage: ``python -m services.sandbox.zygote --socket PATH --preload math,numpy,sympy``
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import signal
import socket
import sys

from services.sandbox import linux
from services.sandbox.runner import create_slot_netns, remount_readonly, serve_connection
from services.sandbox.runtime_view import expose_runtime, runtime_paths


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


def serve(listener: socket.socket) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # runners are reaped automatically
    gc.collect()
    gc.freeze()  # keep GC from touching (and un-sharing) the warm heap in every child
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)
    os.close(devnull)
    while True:
        try:
            conn, _ = listener.accept()
        except InterruptedError:
            continue
        pid = os.fork()
        if pid == 0:
            listener.close()
            try:
                serve_connection(conn)
            finally:
                os._exit(0)
        conn.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--preload", default="")
    parser.add_argument("--writable", default="", help="mount points runners must write (cgroups)")
    parser.add_argument("--netns-slots", default="", help="slots to create a network namespace for")
    args = parser.parse_args(argv)
    linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the service died before we set the death signal
        sys.exit(1)
    listener = bind(args.socket)  # before the filesystem view turns read-only
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    expose_runtime(runtime_paths(package_root))
    # every run's mount namespace is a copy of this read-only view
    remount_readonly(frozenset(m for m in args.writable.split(",") if m))
    preload([m for m in args.preload.split(",") if m])
    create_slot_netns([int(s) for s in args.netns_slots.split(",") if s])
    serve(listener)


if __name__ == "__main__":
    main()
