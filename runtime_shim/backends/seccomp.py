"""The default seccomp profile of a container sandbox, as data (the `linux.seccomp` object of an
OCI config.json; pure).

A deny list on top of an allow-all default: what a container runtime's default profile (Docker's,
moby `profiles/seccomp/default.json`) keeps from a container without extra capabilities fails
with EPERM instead of reaching the kernel. Most of these would be refused by the kernel anyway
for lack of a capability; the profile is the second wall (a kernel bug behind a capability check
is not reachable) and closes what capabilities do not: the key rings (keyctl, add_key,
request_key), user namespaces (unshare / clone with CLONE_NEWUSER: the way to regain every
capability inside a new namespace), io_uring (its operations bypass seccomp), personality flags
that turn off address-space randomisation, and, unless asked for, ptrace and its relatives.

clone3 fails with ENOSYS rather than EPERM, as in Docker: its flags live in a struct that seccomp
cannot read, so it is refused whole, and ENOSYS makes glibc fall back to clone, whose flags it can.

Architectures: x86_64 and its compat ABIs (i386, x32), so that a 32-bit binary cannot reach a
denied call through the other syscall table. Names an architecture lacks are skipped by the
runtime (libseccomp resolves names per architecture).
"""

from __future__ import annotations

import errno
from typing import Any

ARCHITECTURES = ("SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32")

# Refused whole (EPERM): kernel modules and kexec, the key rings, BPF and perf, userfaultfd,
# mounts (old and new API), swap, reboot, the kernel log, accounting, the clocks, file handles
# (open_by_handle_at is the classic container escape), namespace joins, obsolete and
# hardware-port calls, quotas and io_uring.
DENIED = (
    "acct", "add_key", "bpf", "clock_adjtime", "clock_settime", "create_module", "delete_module",
    "finit_module", "fsconfig", "fsmount", "fsopen", "fspick", "get_kernel_syms", "init_module",
    "io_uring_enter", "io_uring_register", "io_uring_setup", "ioperm", "iopl", "kexec_file_load",
    "kexec_load", "keyctl", "lookup_dcookie", "mount", "mount_setattr", "move_mount",
    "name_to_handle_at", "nfsservctl", "open_by_handle_at", "open_tree", "perf_event_open", "pivot_root",
    "query_module", "quotactl", "quotactl_fd", "reboot", "request_key", "setns", "settimeofday",
    "stime", "swapoff", "swapon", "_sysctl", "sysfs", "syslog", "umount", "umount2", "uselib",
    "userfaultfd", "ustat", "vm86", "vm86old",
)
# Looking into or controlling another process: refused unless the sandbox asks for ptrace
# (debuggers, strace). Inside its pid namespace a sandbox sees only its own processes; these are
# refused by default because they are the way kernel bugs of that class are reached.
PTRACE = ("kcmp", "pidfd_getfd", "process_vm_readv", "process_vm_writev", "ptrace")

CLONE_NEWUSER = 0x10000000
# personality(2) flags that weaken the address space: no randomisation (ADDR_NO_RANDOMIZE) and
# executable data (READ_IMPLIES_EXEC). The query (0xffffffff) and the default values stay allowed.
# Each flag costs 31 rules, which runc compiles at every container start (~2 ms per flag measured
# with runc 1.1.5 here): MMAP_PAGE_ZERO and ADDR_COMPAT_LAYOUT are left out (page 0 is still
# guarded by vm.mmap_min_addr; the legacy layout is still randomised).
PERSONALITY_FLAGS = (0x0040000, 0x0400000)


def _rule(names: tuple[str, ...] | list[str], err: int = errno.EPERM, args: list[dict[str, Any]] | None = None
          ) -> dict[str, Any]:
    rule: dict[str, Any] = {"names": list(names), "action": "SCMP_ACT_ERRNO", "errnoRet": err}
    if args:
        rule["args"] = args
    return rule


def _masked_eq(mask: int, value: int, index: int = 0) -> dict[str, Any]:
    # (arg & mask) == value; the OCI form puts the mask in "value" and the datum in "valueTwo"
    return {"index": index, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}


def _personality_rules() -> list[dict[str, Any]]:
    # A rule's conditions on one argument are OR-ed by runc, so "flag set and not the query" is
    # spelled as: the flag set and some other bit of the low 32 clear (the query has them all set;
    # the kernel reads the argument as 32 bits).
    rules = []
    for flag in PERSONALITY_FLAGS:
        for bit in range(32):
            if 1 << bit != flag:
                rules.append(_rule(["personality"], args=[_masked_eq(flag | 1 << bit, flag)]))
    return rules


def default_profile(*, ptrace: bool = False) -> dict[str, Any]:
    """The `linux.seccomp` object (pure). `ptrace`: allow ptrace and its relatives."""
    denied = sorted(DENIED + (() if ptrace else PTRACE))
    syscalls = [
        _rule(denied),
        _rule(["clone"], args=[_masked_eq(CLONE_NEWUSER, CLONE_NEWUSER)]),
        _rule(["unshare"], args=[_masked_eq(CLONE_NEWUSER, CLONE_NEWUSER)]),
        _rule(["clone3"], errno.ENOSYS),
        *_personality_rules(),
    ]
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": list(ARCHITECTURES), "syscalls": syscalls}
