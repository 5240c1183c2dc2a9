"""The runs' seccomp filter, built with libseccomp (PyPI ``pyseccomp``: ctypes over libseccomp.so.2).

Default allow; the calls below fail with ``EPERM`` (no kill), so ordinary libraries that
probe for a feature keep working. Covered: Docker's default denials, every way to make or
join a namespace, the mount family and ``pivot_root``, ``ptrace`` and cross-process memory
access, ``bpf``, ``perf_event_open``, the keyring, ``userfaultfd``, ``io_uring``, module
loading, ``kexec``, ``personality`` (other than the query), and socket families no run needs.

Invariants:
- the program is built once per service (``export``: libseccomp, in a short-lived process of
  the runs' interpreter, generates the BPF, so neither libseccomp nor its bindings sit in a
  zygote's heap, which every run copies); each run installs that same program with one
  ``prctl`` after ``no_new_privs`` and its uid drop, immediately before the code runs
  (``linux.SeccompProgram``; libseccomp's own ``seccomp_load`` would regenerate it per run);
- ``clone`` with any namespace flag is denied; ``clone3`` answers ``ENOSYS``, as under Docker
  and systemd: its flags sit in memory a filter cannot read, and ``ENOSYS`` makes glibc fall
  back to ``clone`` (threads and ``posix_spawn`` keep working) where the flags are checked;
- a call from another syscall ABI (32-bit ``int 0x80``, x32) is denied as a whole;
- an argument the kernel reads as a C ``int`` (a socket's family) is compared on its low 32
  bits only: a family with high bits set is still the same family to the kernel.
"""

from __future__ import annotations

import errno
import os
import subprocess

from services.sandbox import linux

# Docker's default profile denies these (docs.docker.com/engine/security/seccomp), and so do we.
DOCKER_DENIED = (
    "acct", "add_key", "bpf", "clock_adjtime", "clock_settime", "create_module", "delete_module",
    "finit_module", "get_kernel_syms", "get_mempolicy", "init_module", "ioperm", "iopl", "kcmp",
    "kexec_file_load", "kexec_load", "keyctl", "lookup_dcookie", "mbind", "mount", "move_pages",
    "name_to_handle_at", "nfsservctl", "open_by_handle_at", "perf_event_open", "pivot_root",
    "process_vm_readv", "process_vm_writev", "ptrace", "query_module", "quotactl", "reboot",
    "request_key", "set_mempolicy", "setns", "settimeofday", "stime", "swapon", "swapoff", "sysfs",
    "_sysctl", "umount", "umount2", "unshare", "uselib", "userfaultfd", "ustat", "vm86", "vm86old",
)
# Newer kernel interfaces outside Docker's allowlist, and privileged ones a run never needs.
ALSO_DENIED = (
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "quotactl_fd", "pidfd_getfd",
    "process_madvise", "fanotify_init", "syslog", "vhangup", "chroot", "sethostname",
    "setdomainname", "adjtimex", "lsm_set_self_attr", "open_tree_attr",
    "modify_ldt",  # 16-bit segments: emulators only (Wine, DOSEMU), a past source of kernel bugs
)
NAMESPACE_FLAGS = (linux.CLONE_NEWNS | linux.CLONE_NEWUTS | linux.CLONE_NEWIPC | linux.CLONE_NEWPID
                   | linux.CLONE_NEWNET | linux.CLONE_NEWCGROUP | linux.CLONE_NEWUSER | linux.CLONE_NEWTIME)
PERSONALITY_QUERY = 0xFFFFFFFF
LOW32 = 0xFFFFFFFF
# AF_KEY, AF_RDS, AF_ATMPVC, AF_ATMSVC, AF_BLUETOOTH, AF_TIPC, AF_ALG, AF_VSOCK, AF_KCM, AF_SMC, AF_XDP:
# kernel code no run needs (runs have no network at all)
DENIED_SOCKET_FAMILIES = (15, 21, 8, 20, 31, 30, 38, 40, 41, 43, 44)


def denied_calls() -> tuple[str, ...]:
    return DOCKER_DENIED + ALSO_DENIED


def build() -> bytes:
    """The filter as a BPF program (raises ImportError/OSError where libseccomp is unusable)."""
    import pyseccomp as sc  # lazy: only the runs' runtime provides it (runtime-requirements.txt)

    eperm = sc.ERRNO(errno.EPERM)
    flt = sc.SyscallFilter(sc.ALLOW)
    flt.set_attr(sc.Attr.ACT_BADARCH, eperm)
    for name in denied_calls():
        try:
            number = sc.resolve_syscall(sc.Arch.NATIVE, name)
        except (OSError, ValueError):
            continue  # not a call of this architecture (e.g. vm86 on x86-64)
        if number < 0:
            continue
        flt.add_rule(eperm, name)
    for bit in range(64):
        if NAMESPACE_FLAGS & (1 << bit):
            flt.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, 1 << bit, 1 << bit))
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    flt.add_rule(eperm, "personality", sc.Arg(0, sc.NE, PERSONALITY_QUERY))
    for family in DENIED_SOCKET_FAMILIES:  # the family is an int: only its low 32 bits count
        flt.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.MASKED_EQ, LOW32, family))
    with os.fdopen(os.memfd_create("seccomp-bpf"), "w+b") as out:
        flt.export_bpf(out)
        out.seek(0)
        return out.read()


def export(python: str, pythonpath: str, timeout_s: float = 60.0) -> bytes:
    """``build`` run by ``python`` (the runs' interpreter, which has pyseccomp), with this package
    on ``pythonpath``; raises ``RuntimeError`` saying why when it cannot."""
    code = ("import sys\nfrom services.sandbox import syscall_filter\n"
            "sys.stdout.buffer.write(syscall_filter.build())")
    proc = subprocess.run([python, "-s", "-c", code], capture_output=True, timeout=timeout_s, cwd="/",
                          env={"PYTHONPATH": pythonpath, "PATH": "/usr/bin:/bin"})
    if proc.returncode != 0 or not proc.stdout:
        raise RuntimeError(proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or "no output")
    return proc.stdout
