"""Escape probes: model-written programs that try to leave the sandbox, and their verdicts.

Each probe is the source of one run; it prints one line ``PROBE <json>`` with what it
observed, and ``verdict_*`` turns that into a list of breaches (empty: contained). The same
programs run against the service on the host (``tests/integration/test_sandbox_escape.py``)
and inside the compose deployment (``tests/deploy/test_compose_smoke.py``), stateless and
through a session. Invariant: a probe reports what it saw, never a guess: every attempt is
made and its outcome (errno name or success) recorded; a probe that crashes reports nothing,
which ``parse`` turns into a breach.
"""

from __future__ import annotations

import json
from typing import Any

PREFIX = "PROBE "

# --- filesystem: canaries in world-readable host paths, host sockets ----------------------------
_FILES = r"""
import errno, json, os, socket, sys
tag, paths, sockets = TAG, PATHS, SOCKETS
runtime = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}  # visible by design
seen = {}
for p in paths:
    try:
        with open(p) as fh:
            seen[p] = "READ " + fh.read(200)
    except OSError as exc:
        seen[p] = errno.errorcode.get(exc.errno, str(exc.errno))
found = []  # any file or directory whose name carries the tag, anywhere in the run's view
import time
walk_deadline = time.monotonic() + 10  # a view that is the whole host would take forever
for top in ("/",):
    for root, dirs, files in os.walk(top):
        if time.monotonic() > walk_deadline:
            found.append(f"(walk stopped at {root}: the view is too large to search)")
            break
        dirs[:] = [d for d in dirs if os.path.join(root, d) not in ("/proc", "/usr")
                   and os.path.realpath(os.path.join(root, d)) not in runtime]
        for name in dirs + files:
            if tag in name:
                found.append(os.path.join(root, name))
connects = {}
for path in sockets:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(path if not path.startswith("@") else "\0" + path[1:])
        s.sendall(b"probe")
        connects[path] = "CONNECTED"
    except OSError as exc:
        connects[path] = errno.errorcode.get(exc.errno, str(exc.errno))
    finally:
        s.close()
top = sorted(os.listdir("/"))
print("PROBE", json.dumps({"read": seen, "found": found, "connect": connects, "root": top}))
"""


def files_probe(tag: str, paths: list[str], sockets: list[str]) -> str:
    """Reads ``paths``, walks the whole view for names with ``tag``, connects to ``sockets``
    (``@name``: an abstract socket)."""
    return (_FILES.replace("TAG", repr(tag)).replace("PATHS", repr(paths))
            .replace("SOCKETS", repr(sockets)))


def verdict_files(seen: dict[str, Any], tag: str) -> list[str]:
    breaches = [f"read {p}: {v}" for p, v in seen["read"].items() if v.startswith("READ")]
    breaches += [f"found {p}" for p in seen["found"]]
    breaches += [f"connected to {p}" for p, v in seen["connect"].items() if v == "CONNECTED"]
    return breaches


# --- kernel surface: namespaces, mounts, the syscall filter, capabilities ------------------------
_KERNEL = r"""
import ctypes, errno, json, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}
def call(name, nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(nr, *[ctypes.c_ulong(a) for a in args])
    if nr == 56 and r == 0:  # a clone that succeeded: the child leaves at once
        os._exit(0)
    if nr == 56 and r > 0:
        os.waitpid(r, 0)
    out[name] = "OK" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID = 0x10000000, 0x20000, 0x40000000, 0x20000000
call("unshare(NEWUSER)", 272, CLONE_NEWUSER)
call("unshare(NEWNS)", 272, CLONE_NEWNS)
call("unshare(NEWNET)", 272, CLONE_NEWNET)
call("clone(NEWUSER)", 56, CLONE_NEWUSER | 17, 0, 0, 0, 0)
call("clone3", 435, 0, 0)
call("setns", 308, 0, 0)
call("mount", 165, 0, 0, 0, 0, 0)
call("umount2", 166, 0, 0)
call("pivot_root", 155, 0, 0)
child = os.fork()  # a process of our own uid: without the filter, ptrace would be allowed
if child == 0:
    import time
    time.sleep(30)
    os._exit(0)
call("ptrace(ATTACH own child)", 101, 16, child, 0, 0)
os.kill(child, 9)
os.waitpid(child, 0)
call("bpf", 321, 0, 0, 0)
call("perf_event_open", 298, 0, 0, 0, 0, 0)
call("keyctl", 250, 0, 0, 0, 0, 0)
call("add_key", 248, 0, 0, 0, 0, 0)
call("userfaultfd", 323, 0)
call("io_uring_setup", 425, 1, 0)
call("init_module", 175, 0, 0, 0)
call("kexec_load", 246, 0, 0, 0, 0)
call("personality(ADDR_NO_RANDOMIZE)", 135, 0x0040000)
call("open_by_handle_at", 304, 0, 0, 0)
call("modify_ldt", 154, 0, 0, 0)
AF_VSOCK, SOCK_STREAM = 40, 1
for label, family in (("socket(AF_VSOCK)", AF_VSOCK), ("socket(AF_VSOCK | 1 << 32)", AF_VSOCK | 1 << 32)):
    call(label, 41, family, SOCK_STREAM, 0)  # the kernel reads the family's low 32 bits only
try:
    p = subprocess.run(["unshare", "-U", "-r", "id"], capture_output=True, text=True, timeout=10)
    ok = p.returncode == 0
    out["unshare -U -r id"] = ("OK " + p.stdout.strip()) if ok else ("FAILED " + p.stderr.strip()[-80:])
except OSError as exc:
    out["unshare -U -r id"] = "FAILED " + str(exc)
status = {l.split(":")[0]: l.split(":", 1)[1].strip() for l in open("/proc/self/status") if ":" in l}
out["status"] = {k: status.get(k) for k in ("Seccomp", "NoNewPrivs", "CapEff", "CapPrm", "CapBnd", "CapAmb")}
out["uid"] = os.getuid()
try:  # a thread still starts (glibc falls back from clone3 to clone)
    import threading
    t = threading.Thread(target=lambda: None); t.start(); t.join()
    out["thread"] = "OK"
except Exception as exc:
    out["thread"] = repr(exc)
print("PROBE", json.dumps(out))
"""


def kernel_probe() -> str:
    return _KERNEL


DENIED_CALLS = ("unshare(NEWUSER)", "unshare(NEWNS)", "unshare(NEWNET)", "clone(NEWUSER)", "setns", "mount",
                "umount2", "pivot_root", "ptrace(ATTACH own child)", "bpf", "perf_event_open", "keyctl",
                "add_key", "userfaultfd", "io_uring_setup", "init_module", "kexec_load",
                "personality(ADDR_NO_RANDOMIZE)", "open_by_handle_at", "modify_ldt")
# a socket family no run needs: the filter answers EAFNOSUPPORT, as a kernel without it would
DENIED_FAMILIES = ("socket(AF_VSOCK)", "socket(AF_VSOCK | 1 << 32)")


def verdict_kernel(seen: dict[str, Any], *, filter_expected: bool = True) -> list[str]:
    breaches = [f"{name} succeeded" for name in (*DENIED_CALLS, *DENIED_FAMILIES) if seen.get(name) == "OK"]
    if filter_expected:  # the filter's own answer (EPERM, not a kill; clone3: ENOSYS)
        breaches += [f"{name}: {seen.get(name)} (want EPERM from the filter)" for name in DENIED_CALLS
                     if seen.get(name) not in ("EPERM",)]
        breaches += [f"{name}: {seen.get(name)} (want EAFNOSUPPORT from the filter)"
                     for name in DENIED_FAMILIES if seen.get(name) != "EAFNOSUPPORT"]
        if seen.get("clone3") != "ENOSYS":
            breaches.append(f"clone3: {seen.get('clone3')} (want ENOSYS)")
    if str(seen.get("unshare -U -r id", "")).startswith("OK"):
        breaches.append(f"unshare -U -r id: {seen['unshare -U -r id']}")
    st = seen["status"]
    if filter_expected and st.get("Seccomp") != "2":
        breaches.append(f"Seccomp: {st.get('Seccomp')}")
    for key in ("CapEff", "CapPrm", "CapBnd", "CapAmb"):
        if st.get(key) != "0000000000000000":
            breaches.append(f"{key}: {st.get(key)}")
    if st.get("NoNewPrivs") != "1" or int(seen["uid"]) < 1000:
        breaches.append(f"privileges: NoNewPrivs {st.get('NoNewPrivs')}, uid {seen['uid']}")
    if seen.get("thread") != "OK":
        breaches.append(f"threads broke: {seen.get('thread')}")  # over-blocking is a failure too
    return breaches


# --- /proc, /sys and devices -------------------------------------------------------------------
_PROC = r"""
import errno, json, os
out = {"write": {}, "read": {}}
def name(exc): return errno.errorcode.get(exc.errno, str(exc.errno))
for p, data in (("/proc/sys/kernel/hostname", "pwned"), ("/proc/sysrq-trigger", "b"),
                ("/proc/sys/vm/drop_caches", "3"), ("/sys/kernel/uevent_helper", "/tmp/x"),
                ("/sys/fs/cgroup/cgroup.procs", "1"), ("/dev/null", "ok"),
                ("/proc/1/oom_score_adj", "-1000")):
    try:
        with open(p, "w") as fh:
            fh.write(data)
        out["write"][p] = "OK"
    except OSError as exc:
        out["write"][p] = name(exc)
for p in ("/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/proc/kallsyms",
          "/proc/1/environ", "/proc/1/maps", "/sys/class/net", "/dev/mem", "/dev/kmsg", "/dev/sda",
          "/dev/vda", "/dev/tty", "/dev/urandom"):
    try:
        with open(p, "rb") as fh:
            fh.read(16)
        out["read"][p] = "OK"
    except OSError as exc:
        out["read"][p] = name(exc)
out["dev"] = sorted(os.listdir("/dev"))
out["proc"] = sorted(x for x in os.listdir("/proc") if not x.isdigit())
try:
    os.mknod("/tmp/probe-dev", 0o666 | 0o020000, os.makedev(1, 1))  # /dev/mem's numbers
    out["mknod"] = "OK"
except OSError as exc:
    out["mknod"] = name(exc)
print("PROBE", json.dumps(out))
"""

DEV_ALLOWED = ["fd", "full", "null", "random", "shm", "stderr", "stdin", "stdout", "urandom", "zero"]


def proc_probe() -> str:
    return _PROC


def verdict_proc(seen: dict[str, Any]) -> list[str]:
    breaches = [f"wrote {p}" for p, v in seen["write"].items() if v == "OK" and p != "/dev/null"]
    if seen["write"].get("/dev/null") != "OK":
        breaches.append(f"/dev/null not writable: {seen['write'].get('/dev/null')}")  # over-blocking
    breaches += [f"read {p}" for p, v in seen["read"].items() if v == "OK" and p != "/dev/urandom"]
    if seen["dev"] != DEV_ALLOWED:
        breaches.append(f"/dev holds {seen['dev']}")
    if seen["proc"] != ["self", "thread-self"]:
        breaches.append(f"/proc holds {seen['proc']}")
    if seen["mknod"] == "OK":
        breaches.append("mknod of a device succeeded")
    return breaches


# --- another run: its processes and its /tmp ---------------------------------------------------
def victim(tag: str, hold_s: float) -> str:
    """A run that leaves a secret in its /tmp, workdir and /dev/shm, says so, then waits."""
    return (f"import time\nfor p in ('/tmp/{tag}', '{tag}-workdir', '/dev/shm/{tag}'):\n"
            f"    open(p, 'w').write('secret-{tag}')\n"
            f"print('ready', flush=True)\ntime.sleep({hold_s})\nprint('survived')\n")


_NEIGHBOUR = r"""
import ctypes, errno, glob, json, os, signal
tag, pids = TAG, PIDS
out = {"kill": {}, "ptrace": {}, "pidfd": {}, "mem": {}, "found": []}
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def name(e): return errno.errorcode.get(e, str(e))
for pid in pids:
    try:
        os.kill(pid, 0)
        out["kill"][str(pid)] = "OK"
    except OSError as exc:
        out["kill"][str(pid)] = name(exc.errno)
    ctypes.set_errno(0)
    r = libc.syscall(101, 16, pid, 0, 0)  # PTRACE_ATTACH
    out["ptrace"][str(pid)] = "OK" if r == 0 else name(ctypes.get_errno())
    try:
        fd = os.pidfd_open(pid)
        os.close(fd)
        out["pidfd"][str(pid)] = "OK"
    except OSError as exc:
        out["pidfd"][str(pid)] = name(exc.errno)
    try:
        open(f"/proc/{pid}/mem", "rb").close()
        out["mem"][str(pid)] = "OK"
    except OSError as exc:
        out["mem"][str(pid)] = name(exc.errno)
for pattern in ("/tmp/**", "/proc/*/root/tmp/**", "/proc/*/cwd/*", "/dev/shm/*", "/var/tmp/**"):
    for path in glob.glob(pattern, recursive=True):
        try:
            if os.path.isfile(path) and "secret-" + tag in open(path).read(200):
                out["found"].append(path)
        except OSError:
            pass
out["visible_pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
print("PROBE", json.dumps(out))
"""


def neighbour_probe(tag: str, pids: list[int]) -> str:
    """Tries to signal, trace and read the processes ``pids`` (another run's, as the host sees
    them) and to find the other run's secret anywhere in its own view."""
    return _NEIGHBOUR.replace("TAG", repr(tag)).replace("PIDS", repr(pids))


def verdict_neighbour(seen: dict[str, Any]) -> list[str]:
    breaches = []
    for kind in ("kill", "ptrace", "pidfd", "mem"):
        breaches += [f"{kind} {pid}: OK" for pid, v in seen[kind].items() if v == "OK"]
    breaches += [f"found the other run's secret at {p}" for p in seen["found"]]
    if seen["visible_pids"] != [2] and seen["visible_pids"] != [2, 3]:  # itself (and a helper child)
        breaches.append(f"sees pids {seen['visible_pids']}")
    return breaches


def parse(stdout: str) -> dict[str, Any]:
    """The probe's report; raises ``AssertionError`` (a breach by omission) when there is none."""
    for line in stdout.splitlines():
        if line.startswith(PREFIX):
            return json.loads(line[len(PREFIX):])  # type: ignore[no-any-return]
    raise AssertionError(f"the probe reported nothing: {stdout[-2000:]!r}")


CPU_HOG = "import threading\ndef spin():\n    while True:\n        pass\nfor _ in range(4):\n" \
          "    threading.Thread(target=spin, daemon=True).start()\nspin()\n"

CPU_SHARE = r"""
import json, os, threading, time
def spin(until):
    while time.monotonic() < until:
        pass
wall = 2.0
start, cpu0 = time.monotonic(), os.times()
threads = [threading.Thread(target=spin, args=(start + wall,)) for _ in range(THREADS)]
[t.start() for t in threads]
[t.join() for t in threads]
cpu1 = os.times()
used = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
cgroup = [line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup")
          if line.split(":")[1] in ("cpu", "cpu,cpuacct", "")]
print("PROBE", json.dumps({"cores": used / (time.monotonic() - start), "cgroup": cgroup}))
"""


def cpu_share_probe(threads: int) -> str:
    """Spins ``threads`` threads for 2 s of wall time; reports the cores it got (CPU s / wall s)
    and its cpu cgroup (v1 ``cpu`` line, else the v2 one)."""
    return CPU_SHARE.replace("THREADS", str(threads))
