"""OS-level isolation of the lab's candidate process (Linux; needs root).

enter() turns a freshly forked, single-threaded child into a sandbox before untrusted code is
imported: new mount/net/IPC/UTS/PID namespaces, hidden project and history dirs, private scratch
tmpfs, every other mount read-only, a /proc of its own, rlimits, the uid nobody, no new
privileges and a seccomp deny list. Only fds opened before enter() reach the outside world.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import resource
import select
import signal
import stat
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

CLONE_THREAD, CLONE_NEWNS, CLONE_NEWUTS = 0x10000, 0x20000, 0x4000000
CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x8000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOSYMFOLLOW, MS_BIND, MS_REC, MS_PRIVATE = 256, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
_KEEP = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "nosymfollow": MS_NOSYMFOLLOW}
SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")  # fresh private writable tmpfs each
# Denied with EPERM: new processes and programs, debugging others, namespaces and mounts,
# networking, moving to other cores than the evaluator chose, and kernel interfaces a kernel benchmark never needs (large attack surface).
DENY = (
    "execve execveat fork vfork ptrace process_vm_readv process_vm_writev mount umount2 "
    "unshare setns pivot_root chroot open_tree move_mount fsopen fsconfig fsmount fspick "
    "mount_setattr socket socketpair connect bind listen accept accept4 io_uring_setup "
    "io_uring_enter io_uring_register bpf perf_event_open keyctl add_key request_key "
    "kexec_load kexec_file_load init_module finit_module delete_module userfaultfd "
    "personality open_by_handle_at name_to_handle_at pidfd_getfd kcmp sched_setaffinity "
    "sched_setscheduler sched_setattr "
    # SysV IPC: a detached shared-memory segment counts against no rlimit (4 GiB held at a
    # 2 GiB limit, in a red-team review); queues and semaphores are no kernel's business either.
    "shmget shmat shmdt shmctl msgget msgsnd msgrcv msgctl semget semop semtimedop semctl"
).split()
TIOCSTI, TIOCLINUX = 0x5412, 0x541C  # ioctls that type into (or read) the caller's terminal

# Filled by enter() (inherited by the sandboxed process) so the evaluator can report gaps.
STATUS: dict[str, Any] = {}
_PROBE: list[str | None] = []  # unavailable_reason()'s cached answer


class SandboxError(RuntimeError):
    """A sandbox step failed; the message is one line naming the step and errno."""


@dataclass(frozen=True)
class Limits:
    memory_bytes: int = 0  # RLIMIT_AS; 0 = no limit
    cpu_s: int = 600  # RLIMIT_CPU soft; hard = soft + 5 (SIGKILL, as PID 1 ignores SIGXCPU)
    max_files: int = 256  # RLIMIT_NOFILE, raised to the highest open fd + 16
    max_procs: int = 64  # RLIMIT_NPROC: threads of uid nobody, system-wide
    file_bytes: int = 64 << 20  # RLIMIT_FSIZE


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
_libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


def _err(step: str, err: int | None = None) -> SandboxError:
    err = ctypes.get_errno() if err is None else err
    return SandboxError(f"{step} failed: {errno.errorcode.get(err, str(err))} ({os.strerror(err)})")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> int:
    enc = [s.encode() if s else None for s in (src, target, fstype, data)]
    return 0 if _libc.mount(enc[0], enc[1], enc[2], flags, enc[3]) == 0 else ctypes.get_errno()


def _must_mount(step: str, *args: Any) -> None:
    if err := _mount(*args):
        raise _err(f"{step} ({args[1]})", err)


def _setup_mounts(hide: Sequence[str], expose: Sequence[str]) -> list[str]:
    """Steps 2-4; returns the scratch mount points. Scratch comes first so that hidden or
    exposed paths under /tmp are handled against the fresh /tmp, not the host's."""
    _must_mount("make mounts private", None, "/", None, MS_REC | MS_PRIVATE)
    keep = []  # O_PATH fds keep exposed paths reachable after a tmpfs covers their parent
    for path in sorted({os.path.realpath(p) for p in expose}, key=len):
        try:
            keep.append((path, os.open(path, os.O_PATH | os.O_CLOEXEC)))
        except FileNotFoundError:
            continue
    scratch = []
    for path in dict.fromkeys(os.path.realpath(p) for p in SCRATCH):
        if os.path.isdir(path):
            _must_mount(
                "scratch tmpfs", "tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=256m,mode=1777"
            )
            scratch.append(path)
    for path in sorted({os.path.realpath(p) for p in hide}, key=len):
        if os.path.isdir(path):
            _must_mount(
                "hide", "tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=1m,mode=755"
            )
        elif os.path.lexists(path):  # a single file reads as empty
            _must_mount("hide", "/dev/null", path, None, MS_BIND)
    for path, fd in keep:
        if not os.path.lexists(path):  # its mount point, inside a hiding tmpfs
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.makedirs(path)
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
        _must_mount("expose", f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
    os.chdir(scratch[0] if scratch else "/")  # an old cwd could sit under a hidden dir
    return scratch


def _make_readonly(scratch: list[str]) -> list[str]:
    """Step 5: remount every visible mount read-only (MS_BIND: only our copy, never the host's
    superblock). Returns the mounts that refused, as 'path: ERRNO'."""
    with open("/proc/self/mountinfo") as f:
        lines = f.read().splitlines()
    top: dict[str, list[str]] = {}
    for line in lines:  # mounted later = listed later: the last entry per path is the visible one
        fields = line.split()
        path = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
        top[path] = fields[5].split(",")
    failed = []
    for path, opts in top.items():
        if path in scratch or "ro" in opts:
            continue
        keep = sum(_KEEP.get(o, 0) for o in opts)  # flags the kernel may insist on keeping
        for extra in (0, MS_NOSUID | MS_NODEV, MS_NOSUID | MS_NODEV | MS_NOEXEC):
            err = _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep | extra)
            if err != errno.EPERM:
                break
        if err and err not in (errno.ENOENT, errno.EINVAL):  # those two: shadowed, unreachable
            failed.append(f"{path}: {errno.errorcode.get(err, err)}")
    return failed


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("a", ctypes.c_uint64),
        ("b", ctypes.c_uint64),
    ]


def filter_syscalls(extra: Sequence[str] = ()) -> str | None:
    """The seccomp filter alone (no root needed: libseccomp sets no-new-privileges), for a
    candidate that runs without the sandbox. Why it is unavailable, else None."""
    return _install_seccomp(extra)


def _install_seccomp(extra: Sequence[str] = ()) -> str | None:
    """Step 8; returns why libseccomp is unavailable (then nothing is installed), else None."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError as e:
        return f"libseccomp.so.2 not loadable: {e}"
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int]
    lib.seccomp_rule_add_array.argtypes += [ctypes.c_uint, ctypes.POINTER(_ArgCmp)]
    lib.seccomp_load.argtypes = lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.restype = None
    ctx = lib.seccomp_init(0x7FFF0000)  # SCMP_ACT_ALLOW by default; x32/i386 ABIs are killed
    if not ctx:
        raise SandboxError("seccomp_init failed")

    def rule(name: str, err: int, *cmps: _ArgCmp) -> None:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:  # not on this architecture
            return
        arr = (_ArgCmp * max(len(cmps), 1))(*cmps)
        if (rc := lib.seccomp_rule_add_array(ctx, 0x00050000 | err, nr, len(cmps), arr)) < 0:
            raise _err(f"seccomp_rule_add({name})", -rc)

    masked_eq = 7  # SCMP_CMP_MASKED_EQ: (arg & a) == b
    try:
        for name in (*DENY, *extra):
            rule(name, errno.EPERM)
        rule("clone", errno.EPERM, _ArgCmp(0, masked_eq, CLONE_THREAD, 0))  # threads stay allowed
        rule("clone3", errno.ENOSYS)  # glibc then falls back to clone, filtered above
        for cmd in (TIOCSTI, TIOCLINUX):
            rule("ioctl", errno.EPERM, _ArgCmp(1, masked_eq, 0xFFFFFFFF, cmd))
        if (rc := lib.seccomp_load(ctx)) < 0:
            raise _err("seccomp_load", -rc)
    finally:
        lib.seccomp_release(ctx)
    return None


def _prctl(option: int, arg: int, step: str) -> None:
    if _libc.prctl(option, arg, 0, 0, 0) != 0:
        raise _err(step)


def _open_fds() -> list[int]:
    fds = []
    for fd in sorted(map(int, os.listdir("/proc/self/fd"))):
        try:  # the listing's own fd is closed by now
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            pass
    return fds


def _jail(sync_r: int, limits: Limits, uid: int, gid: int, seccomp: bool,
          deny: Sequence[str] = ()) -> None:  # fmt: skip
    """Steps 6-8 in the grandchild, PID 1 of the new PID namespace."""
    if os.read(sync_r, 1) != b"x":  # the intermediate died before releasing us
        os._exit(1)
    _must_mount("mount a fresh /proc", "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    nofile = max(limits.max_files, max(_open_fds()) + 16)
    for res, value in ((resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_NPROC, limits.max_procs),
                       (resource.RLIMIT_FSIZE, limits.file_bytes), (resource.RLIMIT_CORE, 0),
                       (resource.RLIMIT_AS, limits.memory_bytes or resource.RLIM_INFINITY)):  # fmt: skip
        resource.setrlimit(res, (value, value))
    if limits.cpu_s > 0:
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 5))
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "prctl(PR_SET_NO_NEW_PRIVS)")
    os.environ.update(HOME="/tmp", TMPDIR="/tmp")
    tempfile.tempdir = None  # forget a temp dir cached before the sandbox
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)  # clears every capability: no mount, ptrace, chown or root-owned writes
    try:
        os.setuid(0)
        raise SandboxError("setuid(0) still works after dropping privileges")
    except PermissionError:
        pass
    with open("/proc/self/status") as f:
        caps = dict(line.split(":\t", 1) for line in f if line.startswith("Cap"))
    if os.getuid() != uid or os.getgid() != gid or int(caps["CapEff"], 16):
        raise SandboxError(f"privileges not dropped: uid {os.getuid()}, CapEff {caps['CapEff']}")
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")  # after setuid: it resets
    poller = select.poll()
    poller.register(sync_r, select.POLLIN)
    if poller.poll(0):  # hang-up: the intermediate died before the death signal was armed
        os._exit(1)
    os.close(sync_r)
    why = _install_seccomp(deny) if seccomp else "not requested"
    STATUS.update(seccomp_installed=why is None, seccomp_error=why, open_fds=_open_fds())


def enter(*, hide: Sequence[str], expose: Sequence[str], limits: Limits,
          on_pid: Callable[[int], None] | None = None, uid: int = 65534, gid: int = 65534,
          seccomp: bool = True, deny: Sequence[str] = ()) -> None:  # fmt: skip
    """Isolate this (forked, single-threaded) process; returns only in a new grandchild that is
    PID 1 of a new PID namespace. This process waits for it and exits with its status (a signal
    death as 128 + signal). `deny`: system calls denied on top of DENY. Raises SandboxError
    where a step fails (in the grandchild too: then it is partly isolated and must exit rather
    than run anything)."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID
    if _libc.unshare(flags) != 0:
        hint = {errno.EPERM: "needs root: ", errno.EINVAL: "needs a single-threaded process: "}
        raise _err(hint.get(ctypes.get_errno(), "") + "unshare(NEWNS|NEWNET|NEWIPC|NEWUTS|NEWPID)")
    _libc.sethostname(b"sandbox", 7)
    scratch = _setup_mounts(hide, expose)
    STATUS.clear()
    STATUS.update(rw_mounts=_make_readonly(scratch), scratch=scratch)
    sync_r, sync_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(sync_w)
        return _jail(sync_r, limits, uid, gid, seccomp, deny)
    os.close(sync_r)
    code = 1
    try:  # the intermediate: trusted, never returns
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)  # dying takes the grandchild along (PDEATHSIG)
        if on_pid is not None:
            on_pid(pid)
        os.write(sync_w, b"x")  # sync_w stays open: its hang-up tells the grandchild we died
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        code = 128 - code if code < 0 else code
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        os.kill(pid, signal.SIGKILL)
    finally:
        os._exit(code)


def unavailable_reason() -> str | None:
    """None when enter() works here, else one line why. Probed once per process, in a forked
    child (whose namespaces, and so its mounts, vanish with it)."""
    if _PROBE:
        return _PROBE[0]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            enter(hide=(), expose=(), limits=Limits())
            code = 0
        except BaseException as e:  # noqa: BLE001
            os.write(w, f"{type(e).__name__}: {e}".splitlines()[0].encode()[:400])
        finally:
            os._exit(code)
    os.close(w)
    deadline, out = time.monotonic() + 10, b""
    while select.select([r], [], [], max(0.0, deadline - time.monotonic()))[0]:
        if not (chunk := os.read(r, 4096)):
            break
        out += chunk
    os.close(r)
    if time.monotonic() >= deadline:
        os.kill(pid, signal.SIGKILL)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    msg = out.decode(errors="replace") or f"the probe exited with {code}"
    _PROBE.append(None if code == 0 and not out else msg)
    return _PROBE[0]
