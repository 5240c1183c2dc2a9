"""The runs' filesystem: a minimal root, built once per zygote and entered with ``pivot_root``.

Every run (and session) is forked from a zygote that lives in this tree, so a run's mount
namespace starts as a copy of it; the run then adds only its own ``/proc`` and ``/tmp``.

Invariants:
- the tree holds only an allowlist: the system's programs and libraries (``/usr`` without
  ``/usr/local``, which an empty directory covers, and the ``/bin``/``/lib*`` links), the
  runs' Python runtime (its prefixes and ``sys.path`` directories, each at its own path), a
  generated ``/etc`` (passwd/group entries for root, nobody and the run uids; hosts;
  nsswitch; a copy of the loader cache), ``/dev`` with ``DEV_NODES`` only (plus
  ``fd``/``stdin``/``stdout``/``stderr`` links and ``shm`` and ``/var/tmp`` pointing into the
  run's ``/tmp``), and empty ``/proc`` and ``/tmp`` mount points;
- nothing else of the host is reachable: not the checkout or the service's environment, no
  data or models, no ``/root``, ``/home``, ``/srv``, ``/opt``, ``/var``, ``/run``, ``/sys``,
  ``/usr/local`` (unless the runtime lives there), no host unix socket;
- every mount of the tree is read-only and ``nosuid``; device files exist only for
  ``DEV_NODES`` (made with ``mknod`` in the tree's own tmpfs, else bound from the host);
- the tree has few mounts (root, ``/usr``, the ``/usr/local`` cover, the runtime): every run
  copies them into its mount namespace and tears them down again;
- after ``enter``, the old root is detached: the zygote, and every run forked from it, can
  name no host path; what the zygote still needs of the host (cgroup directories, namespace
  handles, its listening socket) it opened before;
- a run's ``/proc`` (``mount_run_proc``) shows the processes of its own pid namespace, and of
  those only the ones it may ptrace (its own uid): nothing else of ``/proc`` (no ``/proc/sys``,
  ``kcore``, ``keys``, ``sysrq-trigger``, ``timer_list``, ...) exists in it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys

from services.sandbox import linux

SYSTEM_DIRS = ("/usr",)
HIDDEN_DIRS = ("/usr/local",)  # site-specific software and data, covered by an empty directory
TOP_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEV_NODES = ("null", "zero", "full", "random", "urandom")
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2", "shm": "/tmp/.shm"}
SHM_DIR = "/tmp/.shm"  # created in each run's /tmp (``/dev/shm`` points there)
HOSTNAME = "sandbox"
# One mount option instead of a mask per file: only the pid directories (and self) exist, and
# of those only the processes the viewer may ptrace (Linux >= 5.8).
PROC_OPTIONS = "subset=pid,hidepid=invisible"
_RO = linux.MS_BIND | linux.MS_REMOUNT | linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NODEV


def runtime_paths(exclude: list[str]) -> list[str]:
    """Directories of the running interpreter's environment (prefixes, ``sys.path``), outermost
    only, without ``exclude`` (the staged ``services`` package: imported before ``enter``) and
    without the working directory (``python -m`` puts it first on ``sys.path``)."""
    skip = {os.path.realpath(p) for p in [*exclude, os.getcwd()] if p}
    candidates = {sys.base_prefix, sys.prefix, *sys.path}
    paths = sorted({os.path.realpath(p) for p in candidates if p and os.path.isdir(p)} - skip)
    if "/" in paths:
        raise ValueError("the runtime's prefix or sys.path includes '/': the whole host would be visible")
    return outermost(paths)


def outermost(paths: list[str]) -> list[str]:
    out: list[str] = []
    for path in sorted(set(paths)):
        if not any(path == q or path.startswith(q.rstrip("/") + "/") for q in out):
            out.append(path)
    return out


def _bind_ro(source: str, target: str, *, dev: bool = False) -> None:
    linux.mount(source, target, None, linux.MS_BIND)
    linux.mount(None, target, None, _RO & ~(linux.MS_NODEV if dev else 0))


def _mkdirs(root: str, path: str) -> str:
    target = root + path
    os.makedirs(target, 0o755, exist_ok=True)
    return target


def _write(root: str, path: str, text: str | bytes, mode: int = 0o644) -> None:
    data = text.encode() if isinstance(text, str) else text
    fd = os.open(root + path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def etc_files(uids: range) -> dict[str, str]:
    """``/etc`` of the tree: accounts for root, nobody and each run uid; no host secret."""
    users = ["root:x:0:0:root:/root:/usr/sbin/nologin",
             "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin"]
    groups = ["root:x:0:", "nogroup:x:65534:"]
    for uid in uids:
        users.append(f"run{uid - uids.start}:x:{uid}:{uid}:sandboxed run:/tmp/workspace:/bin/sh")
        groups.append(f"run{uid - uids.start}:x:{uid}:")
    return {"/etc/passwd": "\n".join(users) + "\n", "/etc/group": "\n".join(groups) + "\n",
            "/etc/hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost\n",
            "/etc/hostname": HOSTNAME + "\n",
            "/etc/nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n"}


def _dev_nodes(root: str) -> None:
    """``DEV_NODES`` as device files of the tree's tmpfs (``CAP_MKNOD``), else as bind mounts."""
    for node in DEV_NODES:
        st = os.stat(f"/dev/{node}")
        try:
            os.mknod(f"{root}/dev/{node}", 0o666 | stat.S_IFCHR, st.st_rdev)
            os.chmod(f"{root}/dev/{node}", 0o666)
        except PermissionError:
            _write(root, f"/dev/{node}", b"", 0o666)
            _bind_ro(f"/dev/{node}", f"{root}/dev/{node}", dev=True)


def _under(path: str, dirs: tuple[str, ...] | list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def build(root: str, runtime: list[str], uids: range) -> list[str]:
    """Mount the tree at ``root`` (in the caller's private mount namespace); returns the host
    paths bound into it (for the zygote's report)."""
    # no MS_NODEV: the tree's own device files (mknod, by root, before it turns read-only)
    linux.mount("tmpfs", root, "tmpfs", linux.MS_NOSUID, "size=16m,mode=0755")
    bound: list[str] = []
    for path in TOP_LINKS:
        if os.path.islink(path):
            os.symlink(os.readlink(path), root + path)
    tops = [p for p in TOP_LINKS if os.path.isdir(p) and not os.path.islink(p)]
    system = outermost([*(p for p in SYSTEM_DIRS if os.path.isdir(p)), *tops])
    # runtime directories the system binds do not already show (not in them, or under a cover)
    extra = [p for p in outermost(runtime) if not os.path.islink(p)
             and (not _under(p, system) or _under(p, HIDDEN_DIRS))]
    for path in system:
        _bind_ro(path, _mkdirs(root, path))
        bound.append(path)
    for cover in HIDDEN_DIRS:
        if not os.path.isdir(root + cover) or os.path.islink(cover):
            continue
        linux.mount("tmpfs", root + cover, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "size=4k,mode=0755")
        for path in extra:
            if _under(path, [cover]) and path != cover:
                _mkdirs(root, path)  # mount points for the runtime inside the cover
        linux.mount(None, root + cover, None, linux.MS_REMOUNT | linux.MS_RDONLY | linux.MS_NOSUID
                    | linux.MS_NODEV, "size=4k,mode=0755")
    for path in extra:
        if not os.path.isdir(root + path):
            _mkdirs(root, path)
        _bind_ro(path, root + path)
        bound.append(path)
    _mkdirs(root, "/etc")
    for path, text in etc_files(uids).items():
        _write(root, path, text)
    with contextlib.suppress(OSError), open("/etc/ld.so.cache", "rb") as fh:
        _write(root, "/etc/ld.so.cache", fh.read())
    _mkdirs(root, "/dev")
    _dev_nodes(root)
    for name, target in DEV_LINKS.items():
        os.symlink(target, f"{root}/dev/{name}")
    for path in ("/proc", "/tmp"):
        _mkdirs(root, path)
    _mkdirs(root, "/var")
    os.symlink("/tmp", f"{root}/var/tmp")
    return bound


def enter(root: str) -> None:
    """``pivot_root`` into the built tree, detach the old root, make the tree read-only."""
    old = os.path.join(root, ".old-root")
    os.mkdir(old, 0o700)
    linux.pivot_root(root, old)
    os.chdir("/")
    linux.umount2("/.old-root", linux.MNT_DETACH)
    os.rmdir("/.old-root")
    linux.mount(None, "/", None, _RO & ~linux.MS_NODEV)  # the tree's own device files stay usable


def build_and_enter(root: str, runtime: list[str], uids: range) -> list[str]:
    """A private mount and UTS namespace holding only the tree (see the module's invariants)."""
    linux.unshare(linux.CLONE_NEWNS | linux.CLONE_NEWUTS)
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    linux.sethostname(HOSTNAME)  # runs share this UTS namespace: they cannot change it (no caps)
    bound = build(root, runtime, uids)
    enter(root)
    return bound


def mount_run_proc() -> None:
    """The run's ``/proc`` (called in its own mount and pid namespaces)."""
    linux.mount("proc", "/proc", "proc", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC, PROC_OPTIONS)
