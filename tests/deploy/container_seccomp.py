"""The sandbox container's own seccomp profile, probed from a process that is not a run.

``PROBE`` is run with ``docker compose exec`` in the sandbox's container: root with the
container's capabilities (``SYS_ADMIN`` among them), as a compromised service or zygote would
be, under the container's profile only (``deploy/docker/sandbox-seccomp.json``) and not the
runs' own filter. It makes each call and records the outcome (errno name, or ``OK``); calls
with lasting effects (namespaces, keys, personality) run in a forked child.

Invariants:
- every call in ``DENIED`` would succeed, or fail with another errno than ``EPERM``, for this
  process without the profile (root, ``SYS_ADMIN``, on a kernel with these features): the
  profile is what answers ``EPERM`` (``unconfined`` shows the difference, see docs/sandbox-security.md);
- every call in ``ALLOWED`` is one the service makes to build a run: the profile must let it
  through (over-blocking fails as loudly as under-blocking);
- the script only observes and reports (one JSON line); ``breaches`` judges.
"""

from __future__ import annotations

from typing import Any

PROBE = r"""
import ctypes, errno, json, os, socket, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
keep = []
def ptr(data):
    buf = ctypes.create_string_buffer(data)
    keep.append(buf)
    return ctypes.addressof(buf)
def raw(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_ulong(a % (1 << 64)) for a in args])
    if nr == 56 and r == 0:  # the child of a clone that succeeded leaves at once
        os._exit(0)
    if nr == 56 and r > 0:
        os.waitpid(r, 0)
    return "OK" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
def isolated(*calls):
    # each call in order in a forked child (its namespaces, keys, personality die with it); the last outcome
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rd)
        res = "no call"
        try:
            for call in calls:
                res = raw(*call)
                if res != "OK":
                    break
        except BaseException as exc:
            res = repr(exc)
        os.write(wr, res.encode())
        os._exit(0)
    os.close(wr)
    got = os.read(rd, 200).decode()
    os.close(rd)
    _, status = os.waitpid(pid, 0)
    return got or f"died ({status:#x})"
NEWNS, NEWUTS, NEWIPC, NEWNET, NEWPID = 0x20000, 0x4000000, 0x8000000, 0x40000000, 0x20000000
NEWUSER, NEWCGROUP, NEWTIME, SIGCHLD = 0x10000000, 0x2000000, 0x80, 17
SELF = os.getpid()
net = os.open("/proc/self/ns/net", os.O_RDONLY)
user = os.open("/proc/self/ns/user", os.O_RDONLY)
out = {}
denied = {
    "keyctl(GET_KEYRING_ID)": (250, 0, -3, 1),
    "add_key(user)": (248, ptr(b"user"), ptr(b"retool-probe"), ptr(b"x"), 1, -2),
    "request_key": (249, ptr(b"user"), ptr(b"retool-probe"), 0, -2),
    "bpf(MAP_CREATE)": (321, 0, 0, 0),
    "perf_event_open": (298, 0, 0, -1, -1, 0),
    "ptrace(TRACEME)": (101, 0, 0, 0, 0),
    "process_vm_readv(self)": (310, SELF, 0, 0, 0, 0, 0),
    "kcmp(self)": (312, SELF, SELF, 0, 0, 0),
    "userfaultfd(USER_MODE_ONLY)": (323, 1),
    "io_uring_setup": (425, 1, 0),
    "unshare(NEWUSER)": (272, NEWUSER),
    "unshare(NEWCGROUP)": (272, NEWCGROUP),
    "unshare(NEWTIME)": (272, NEWTIME),
    "unshare(NEWNS|NEWUSER)": (272, NEWNS | NEWUSER),
    "clone(NEWUSER)": (56, NEWUSER | SIGCHLD, 0, 0, 0, 0),
    "clone(NEWNET)": (56, NEWNET | SIGCHLD, 0, 0, 0, 0),
    "setns(net, any type)": (308, net, 0),
    "setns(user, NEWUSER)": (308, user, NEWUSER),
    "setns(net, NEWNET | 1 << 32)": (308, net, NEWNET | 1 << 32),
    "personality(ADDR_NO_RANDOMIZE)": (135, 0x40000),
    "socket(AF_VSOCK)": (41, 40, 1, 0),
    "socket(AF_VSOCK | 1 << 32)": (41, 40 | 1 << 32, 1, 0),
    "modify_ldt(read)": (154, 0, 0, 0),
    "name_to_handle_at": (303, -100, ptr(b"/"), 0, 0, 0),
    "fanotify_init": (300, 0, 0),
    "set_mempolicy(DEFAULT)": (238, 0, 0, 0),
    "get_mempolicy": (239, 0, 0, 0, 0, 0),
    "pidfd_getfd(self)": (438, 0, 0, 0),
}
for name, call in denied.items():
    out[name] = isolated(call)
allowed = {  # what the service does to build a run
    "unshare(NEWNS|NEWUTS|NEWIPC|NEWNET|NEWPID)": [(272, NEWNS | NEWUTS | NEWIPC | NEWNET | NEWPID)],
    "setns(net, NEWNET)": [(308, net, NEWNET)],
    "setns(pid, NEWPID)": [(272, NEWPID), (308, os.open("/proc/self/ns/pid", os.O_RDONLY), NEWPID)],
    "mount(tmpfs) in a new mount namespace": [
        (272, NEWNS), (165, 0, ptr(b"/"), 0, 0x40000 | 0x4000, 0),
        (165, ptr(b"tmpfs"), ptr(b"/tmp"), ptr(b"tmpfs"), 0, ptr(b"size=1m"))],
    "umount2 in a new mount namespace": [
        (272, NEWNS), (165, 0, ptr(b"/"), 0, 0x40000 | 0x4000, 0),
        (165, ptr(b"tmpfs"), ptr(b"/tmp"), ptr(b"tmpfs"), 0, ptr(b"size=1m")), (166, ptr(b"/tmp"), 2)],
    "sethostname in a new UTS namespace": [(272, NEWUTS), (170, ptr(b"sandbox"), 7)],
    "personality(query)": [(135, 0xFFFFFFFF)],
    "socket(AF_UNIX)": [(41, 1, 1, 0)],
    "socket(AF_INET)": [(41, 2, 1, 0)],
    "clone(SIGCHLD)": [(56, SIGCHLD, 0, 0, 0, 0)],
}
for name, calls in allowed.items():
    out[name] = isolated(*calls)
out["clone3"] = raw(435, 0, 0)
out["x32 getpid"] = isolated((0x40000000 | 39,))
t = threading.Thread(target=lambda: None)
t.start()
t.join()
out["thread"] = "OK"
status = {l.split(":")[0]: l.split(":", 1)[1].strip() for l in open("/proc/self/status") if ":" in l}
out["status"] = {k: status.get(k) for k in ("Seccomp", "Seccomp_filters", "NoNewPrivs", "CapEff")}
out["uid"] = os.getuid()
print(json.dumps(out))
"""

DENIED = ("keyctl(GET_KEYRING_ID)", "add_key(user)", "request_key", "bpf(MAP_CREATE)", "perf_event_open",
          "ptrace(TRACEME)", "process_vm_readv(self)", "kcmp(self)", "userfaultfd(USER_MODE_ONLY)",
          "io_uring_setup", "unshare(NEWUSER)", "unshare(NEWCGROUP)", "unshare(NEWTIME)",
          "unshare(NEWNS|NEWUSER)", "clone(NEWUSER)", "clone(NEWNET)", "setns(net, any type)",
          "setns(user, NEWUSER)", "setns(net, NEWNET | 1 << 32)", "personality(ADDR_NO_RANDOMIZE)",
          "socket(AF_VSOCK)", "socket(AF_VSOCK | 1 << 32)", "modify_ldt(read)", "name_to_handle_at",
          "fanotify_init", "set_mempolicy(DEFAULT)", "get_mempolicy", "pidfd_getfd(self)")
ALLOWED = ("unshare(NEWNS|NEWUTS|NEWIPC|NEWNET|NEWPID)", "setns(net, NEWNET)", "setns(pid, NEWPID)",
           "mount(tmpfs) in a new mount namespace", "umount2 in a new mount namespace",
           "sethostname in a new UTS namespace", "personality(query)", "socket(AF_UNIX)", "socket(AF_INET)",
           "clone(SIGCHLD)", "thread")


def breaches(seen: dict[str, Any]) -> list[str]:
    """What the report shows the profile failing at (empty: it holds and the service's calls pass)."""
    found = [f"{name}: {seen.get(name)} (want EPERM from the profile)" for name in DENIED
             if seen.get(name) != "EPERM"]
    found += [f"{name}: {seen.get(name)} (the service needs it)" for name in ALLOWED
              if seen.get(name) != "OK"]
    if seen.get("clone3") != "ENOSYS":
        found.append(f"clone3: {seen.get('clone3')} (want ENOSYS)")
    if seen.get("x32 getpid") == "OK":
        found.append("x32 getpid: OK (another syscall ABI got through)")
    st = seen["status"]
    if st.get("Seccomp") != "2" or st.get("Seccomp_filters") != "1":
        found.append(f"status: {st} (want one filter: the container's)")
    if int(seen["uid"]) != 0 or st.get("CapEff") == "0000000000000000":
        found.append(f"not the service's privileges (uid {seen['uid']}, CapEff {st.get('CapEff')}): "
                     "the probe would prove nothing")
    return found
