"""The evaluator's kernel servers: processes forked by zygote.py that run kernels on inputs
the evaluator writes into shared memory, one call per message, and say where their outputs
are (the evaluator reads them out of the server's memory itself).

Two servers per evaluation: a trusted one (the baseline, the reference where it differs,
the roofline peaks) and one for the candidate. The candidate's server is isolated before the
candidate's source is even compiled (sandbox.py: namespaces, read-only mounts, uid nobody,
seccomp; rlimits and an audit hook where that is unavailable) and is trusted with nothing:
the evaluator times every call itself (from the request until it has read the outputs),
checks every call's outputs, counts the process's CPU time from the host's /proc, and never
reads anything from it but JSON and tensor bytes it validates.
"""

from __future__ import annotations

import json
import linecache
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


class Rejected(Exception):
    def __init__(self, flag: str, msg: str):
        super().__init__(msg)
        self.flag = flag


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()  # device-wide: work queued on any stream is waited for


def load_source(text: str, name: str, filename: str | None = None) -> ModuleType:
    """Run a kernel source as module `name` from `filename` (default NAME.py; registered with
    linecache, so tracebacks and Triton's inspect.getsource work without a file on disk)."""
    filename = filename or f"{name}.py"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    mod = ModuleType(name)
    mod.__file__ = filename
    sys.modules[name] = mod
    exec(compile(text, filename, "exec"), mod.__dict__)  # noqa: S102  (the point of a lab)
    if not callable(getattr(mod, "kernel", None)):
        raise AttributeError(f"{filename} defines no callable kernel(...)")
    return mod


_PERF = __import__("time").perf_counter  # captured before any candidate code runs


def grad_rule(outs: tuple, seed: int, pool=None) -> list:
    """Upstream gradient of a call: a window of `pool` (N(0, 1) values the evaluator drew
    once) at an offset given by the call's seed, 0 where the output is not finite (masked
    slots). The evaluator computes it from the forward outputs it read, between the two
    halves of a call, for every server alike (and for the references it computes itself).
    Outputs larger than the pool draw their own."""
    import torch

    g = None
    res = []
    for i, o in enumerate(outs):
        if not o.is_floating_point():
            res.append(None)
            continue
        n = o.numel()
        if pool is not None and n <= pool.numel():
            start = (seed + 7919 * i) % (pool.numel() - n + 1)
            r = pool[start : start + n].view(o.shape).to(o.device, o.dtype)
        else:
            g = g or torch.Generator().manual_seed(seed ^ 0x5DEECE66D)
            r = torch.randn(o.shape, generator=g).to(o.device, o.dtype)
        # A finite sum means every element is finite (inf or NaN would propagate): one pass
        # instead of isfinite's several, inside the timed call.
        if bool(torch.isfinite(o.detach().sum())):
            res.append(r)
        else:
            res.append(r.masked_fill(~torch.isfinite(o.detach()), 0.0))
    return res


def _as_tuple(out):
    return tuple(out) if isinstance(out, tuple | list) else (out,)


def forward(fn: Callable, inputs: dict, mode: str, grad_names: list[str]) -> tuple[tuple, dict]:
    """The first half of a call: fn's outputs and, for fwd_bwd, the leaves whose gradients the
    second half computes (the graph is kept in between). A kernel server answers this half
    before it is told the upstream gradient: a forward that knew it could fuse the backward
    into itself, which no training step allows."""
    import torch

    if mode == "fwd":
        with torch.no_grad():
            return _as_tuple(fn(*inputs.values())), {}
    args = dict(inputs)
    leaves = {n: inputs[n].detach().requires_grad_(True) for n in grad_names}
    args.update(leaves)
    outs = _as_tuple(fn(*args.values()))
    check_tensors(outs, None)
    return outs, leaves


def backward(outs: tuple, leaves: dict, grads: list, run_backward: Callable | None = None) -> tuple:
    """The second half: the gradients of the leaves for upstream gradients `grads` (aligned
    with the outputs) -> outputs + gradients, in the leaves' order."""
    import torch

    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
    if len(outs) != len(grads) or any(not o.requires_grad for o, _ in pairs):
        raise Rejected("no_graph", "an output that needs a gradient is detached from the inputs")
    (run_backward or torch.autograd.backward)([o for o, _ in pairs], [g for _, g in pairs])
    for n, t in leaves.items():
        if t.grad is None:
            raise Rejected("no_grad", f"no gradient reached input {n}")
    return tuple(o.detach() for o in outs) + tuple(t.grad for t in leaves.values())


def call(fn: Callable, inputs: dict, mode: str, grad_names: list[str], grad_out) -> tuple:
    """One run of fn in this process: outputs (+ gradients of grad_names when mode ==
    fwd_bwd). grad_out is a list aligned with the outputs, or a callable outs -> list."""
    outs, leaves = forward(fn, inputs, mode, grad_names)
    if mode == "fwd":
        return outs
    return backward(outs, leaves, grad_out(outs) if callable(grad_out) else grad_out)


def check_tensors(outs: tuple, device: str | None) -> None:
    """Only plain, materialised tensors count as results: a subclass or a lazy wrapper could
    compute on access (after the clock stopped)."""
    import torch

    for i, o in enumerate(outs):
        if type(o) is not torch.Tensor:
            raise Rejected("lazy", f"output {i} is a {type(o).__name__}, not a plain torch.Tensor")
        if o.layout != torch.strided or o.is_meta:
            raise Rejected("lazy", f"output {i} is not a materialised strided tensor")
        if device is not None and o.device.type != device:
            raise Rejected("device", f"output {i} is on {o.device.type}, expected {device}")


def _poison(shapes) -> None:
    """Fill freed allocator blocks of the outputs' sizes with NaN, so an output buffer taken
    with torch.empty and left partly unwritten shows NaN, not a previous run's numbers."""
    import torch

    junk = [torch.full(s, float("nan")) for s in shapes]
    del junk


def measure_peaks(device: str) -> dict:
    """This process's matmul FLOP/s (best of fp32 and bf16) and copy bandwidth: the roofline."""
    import torch

    n, nbytes = (4096, 1 << 30) if device == "cuda" else (512, 1 << 25)
    best_f = 0.0
    for dt in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n, device=device).to(dt)
        for _ in range(4):
            _sync(device)
            t0 = _PERF()
            a @ a
            _sync(device)
            best_f = max(best_f, 2 * n**3 / max(_PERF() - t0, 1e-9))
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    best_b = 0.0
    for _ in range(4):
        _sync(device)
        t0 = _PERF()
        dst.copy_(src)
        _sync(device)
        best_b = max(best_b, 2 * nbytes / max(_PERF() - t0, 1e-9))
    return {"flops": best_f, "bytes_per_s": best_b}


# Audit events a candidate has no business raising (defence in depth behind the policy).
_DENIED_EVENTS = frozenset({
    "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
    "subprocess.Popen", "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle",
    "ctypes.call_function", "os.kill", "os.killpg", "os.remove", "os.rename", "os.rmdir",
    "os.mkdir", "os.truncate", "os.link", "os.symlink", "os.chmod", "os.chown", "os.utime",
    "os.chdir", "os.putenv", "os.unsetenv", "resource.setrlimit", "resource.prlimit",
    "sys.settrace", "sys.setprofile", "socket.connect", "socket.bind", "shutil.rmtree",
    "shutil.move", "shutil.copyfile", "mmap.__new__", "pty.spawn",
})  # fmt: skip
_PATH_EVENTS = frozenset({"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.truncate",
                          "os.link", "os.symlink", "os.chmod", "os.utime", "shutil.rmtree",
                          "shutil.move", "shutil.copyfile"})  # fmt: skip
# CUDA tasks: Triton compiles on first call (ptxas, a C launcher built with cc) and writes its
# cache, so those executables and writes outside the job folder stay allowed there.
_COMPILERS = frozenset({"ptxas", "gcc", "cc", "clang", "nvcc", "ld", "ldconfig", "cuobjdump",
                        "nvdisasm", "x86_64-linux-gnu-gcc"})  # fmt: skip


def _lockdown(jobdir: Path, compilers: bool) -> None:
    """Before the candidate is imported: no processes, signals, dlopen, file writes (the files
    this process writes are open already), thread-count changes. Audit hooks cannot be removed
    once installed; torch.set_num_threads / set_num_interop_threads become raising stubs."""
    import os

    import torch

    write = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    jail = os.path.realpath(jobdir)
    # Bound here: the hook must not read module globals a candidate can rebind.
    denied, path_events, compiler_names = _DENIED_EVENTS, _PATH_EVENTS, _COMPILERS

    def outside_job(path) -> bool:
        if not isinstance(path, str | bytes | os.PathLike):
            return False  # a file descriptor: could be one of the job's files
        p = os.path.realpath(os.fsdecode(path))
        return compilers and p != jail and not p.startswith(jail + os.sep)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            mode = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
            if (flags & write or any(c in mode for c in "wax+")) and not outside_job(args[0]):
                raise PermissionError(f"lab candidate: opening {args[0]!r} for writing")
        elif event in denied:
            if compilers and event in ("subprocess.Popen", "os.posix_spawn"):
                exe, argv = args[0], args[1]
                if exe is None and argv:
                    exe = argv if isinstance(argv, str | bytes) else argv[0]
                if isinstance(exe, str | bytes | os.PathLike):
                    if os.path.basename(os.fsdecode(exe)) in compiler_names:
                        return
            if compilers and event in ("ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle"):
                return
            if compilers and event in path_events and args and outside_job(args[0]):
                if event != "os.rename" or outside_job(args[1]):
                    return
            raise PermissionError(f"lab candidate: {event} is not allowed")

    def no_threads(*_a, **_k):
        raise PermissionError("lab candidate: the thread count is fixed by the task")

    torch.set_num_threads = no_threads
    torch.set_num_interop_threads = no_threads
    sys.addaudithook(hook)


def _trim(tb: str, lines: int = 14) -> str:
    """The end of a traceback (where the candidate failed), not the evaluator's frames."""
    return "\n".join(tb.rstrip().splitlines()[-lines:])


def _send(sock: socket.socket, msg: dict) -> None:
    sock.send(json.dumps(msg).encode())


def _failure(e: BaseException) -> dict:
    if isinstance(e, Rejected):
        return {"ok": False, "status": "rejected", "flag": e.flag, "message": str(e)}
    return {"ok": False, "status": "error", "message": f"{type(e).__name__}: {e}"[:2000],
            "traceback": _trim(traceback.format_exc())}  # fmt: skip


# What torch.autograd.backward runs through: replaced by a candidate, the backward the lab
# times would be its own, not the autograd of the kernel it exports.
_AUTOGRAD_ENTRY_POINTS = ("torch.autograd.backward", "torch.autograd._engine_run_backward",
                          "torch.autograd.graph._engine_run_backward",
                          "torch.autograd.variable.Variable._execution_engine")  # fmt: skip


def _entry_points() -> list[tuple[str, object, str, object]]:
    """(name, owner, attribute, object) of each autograd entry point torch has here."""
    import pkgutil

    out = []
    for dotted in _AUTOGRAD_ENTRY_POINTS:
        owner_name, _, attr = dotted.rpartition(".")
        try:
            owner = pkgutil.resolve_name(owner_name)
            out.append((dotted, owner, attr, getattr(owner, attr)))
        except (AttributeError, ImportError, ValueError):
            pass  # not in this torch version
    return out


def make_serve(sock: socket.socket, buf, spec: dict, peaks: dict) -> Callable[[dict], None]:
    """The serving loop, every harness function it calls bound now, before any candidate code
    runs: a candidate that rebinds this module's globals (worker.call, forward, ...) or the
    buffer's methods changes nothing that runs in its calls. The loop answers `call` (inputs
    in the buffer -> outputs described by address; the evaluator reads them out of this
    process's memory before it sends anything else; for fwd_bwd in two halves: the forward,
    then, given the upstream gradients, the gradients of the inputs), `peaks` (roofline,
    measured at start), `exit`; it returns when the evaluator hangs up. A kernel that takes
    the socket over saves the harness nothing but autograd: the upstream gradient and every
    copy of a result are made by the evaluator, outside this process."""
    import torch

    from wanka.lab.shm import decode_inputs, describe

    device, mode, grad_names = spec["device"], spec["mode"], spec["grad_inputs"]
    fwd, bwd, check, sync, send, failure, poison = (forward, backward, check_tensors, _sync,
        _send, _failure, _poison)  # fmt: skip
    loads, recv, get, get_attr = json.loads, sock.recv, buf.get, getattr
    run_backward = torch.autograd.backward
    watched = _entry_points()

    def described(outs: tuple, held: list) -> list:
        check(outs, device)
        pairs = [describe(o) for o in outs]
        held[:] = [t for _, t in pairs]  # alive until the evaluator has read them
        return [m for m, _ in pairs]

    def backward_half(outs: tuple, leaves: dict, held: list) -> tuple:
        # The forward's outputs go out first: the evaluator reads them and only then writes
        # the upstream gradients, so the backward cannot have been done already.
        send(sock, {"ok": True, "phase": "forward", "outs": described(outs, held)})
        nxt = loads(recv(1 << 16) or b"null")
        if not isinstance(nxt, dict) or nxt.get("op") != "backward":
            raise EOFError("the evaluator did not ask for the backward")
        changed = [name for name, owner, attr, obj in watched
                   if get_attr(owner, attr, None) is not obj]  # fmt: skip
        if changed:
            raise Rejected("tamper", f"the kernel replaced {', '.join(changed)}")
        grads = [None if m is None else get(m).to(device) for m in nxt["grads"]]
        return bwd(outs, leaves, grads, run_backward)[len(outs) :]

    def loop(kernels: dict[str, Callable]) -> None:
        held: list = []
        while True:
            data = recv(1 << 16)
            held.clear()  # the evaluator has read the last reply's tensors
            if not data:
                return
            msg = loads(data)
            if msg["op"] == "exit":
                return
            if msg["op"] == "peaks":
                send(sock, peaks)
                continue
            inputs = None
            try:
                inputs = decode_inputs(buf, msg["inputs"], device)
                if msg.get("poison"):
                    poison([tuple(s) for s in msg["poison"]])
                outs, leaves = fwd(kernels[msg["kernel"]], inputs, mode, grad_names)
                if mode == "fwd_bwd":
                    sync(device)
                    outs = backward_half(outs, leaves, held)
                sync(device)
                reply = {"ok": True, "outs": described(outs, held)}
            except EOFError:
                return
            except BaseException as e:  # noqa: BLE001  (a candidate may raise anything)
                reply = failure(e)
            del inputs
            send(sock, reply)

    return loop


def _fix_malloc() -> None:
    """glibc adapts its mmap threshold to the largest block freed so far, and grows and
    trims its heap with the process's history, so a server whose heap happens to be large
    allocates without page faults and looks faster (identical code measured 13 to 40 ms per
    call in two servers, up to 1.6x apart). Fixed thresholds and a heap that is never
    trimmed, as a long-running training process reaches, make every server alike."""
    from wanka.device import keep_freed_host_memory

    keep_freed_host_memory()


def _warm_heap(pool_bytes: int = 256 << 20) -> None:
    """Touch a pool of heap once, in the process that runs the kernels (after the sandbox's
    fork: pages inherited from a parent would fault again, copied on write), so calls that
    allocate below the mmap threshold see no page faults however the heap grew before."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        chunk = 8 << 20  # below the mmap threshold: served from (and returned to) the heap
        blocks = [libc.malloc(chunk) for _ in range(pool_bytes // chunk)]
        for b in blocks:
            if b:
                ctypes.memset(b, 0, chunk)
        for b in blocks:
            if b:
                libc.free(b)
    except (OSError, AttributeError):
        pass


def _limit(spec: dict) -> None:
    """Without the sandbox: address space (CPU tasks: CUDA maps far more than it uses), CPU
    seconds and file size (the sandbox's limits; a sparse 1 TiB stderr once filled the
    evaluator reading it)."""
    import resource

    from wanka.lab.sandbox import Limits

    if spec["memory_bytes"]:
        m = spec["memory_bytes"]
        resource.setrlimit(resource.RLIMIT_AS, (m, m))
    resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu_s"], spec["cpu_s"] + 5))
    resource.setrlimit(resource.RLIMIT_FSIZE, (Limits.file_bytes, Limits.file_bytes))


def start(sock: socket.socket, spec: dict) -> None:
    """Entry of a forked server. Everything trusted happens first: output files, the shared
    buffer, the trusted kernels, the candidate's source read as text; then the isolation;
    only then is untrusted source compiled. Reports {"pid"} (the host's pid of the process
    that runs the kernels), then {"ready"} or the import error, then serves."""
    import os

    import torch

    from wanka.lab import sandbox
    from wanka.lab.shm import Buffer

    jobdir, role, device = Path(spec["jobdir"]), spec["role"], spec["device"]
    for fd, name in ((1, f"{role}.out"), (2, f"{role}.err")):
        f = os.open(jobdir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    os.environ.update(WANKA_OPS_POISON="1", OMP_NUM_THREADS=str(spec["threads"]))
    torch.set_num_threads(spec["threads"])
    _fix_malloc()
    if spec.get("cpus"):  # both servers on the same cores: the scheduler cannot favour one
        os.sched_setaffinity(0, spec["cpus"])
    buf = Buffer(jobdir / f"{role}.shm", spec["nbytes"])
    kernels: dict[str, Callable] = {}
    untrusted: dict[str, str] = {}
    for name, k in spec["kernels"].items():
        if "ref" in k:
            import importlib

            mod, fn = k["ref"].split(":")
            kernels[name] = getattr(importlib.import_module(mod), fn)
        elif k["trusted"]:
            kernels[name] = load_source(Path(k["file"]).read_text(), f"lab_{name}").kernel
        else:
            untrusted[name] = Path(k["file"]).read_text()
    # memfds hold memory no rlimit counts (RLIMIT_FSIZE caps one, not how many): a CPU kernel
    # needs none. CUDA's runtime may, so there the memory limit is weaker.
    # Nor truncate: without the sandbox the shared buffer's path is reachable, and a buffer cut
    # short is a SIGBUS in the evaluator, which maps it too.
    deny = ("memfd_create", "truncate", "ftruncate") if device == "cpu" else ()
    if spec["isolate"]:
        limits = sandbox.Limits(memory_bytes=spec["memory_bytes"], cpu_s=spec["cpu_s"])
        sandbox.enter(hide=spec["hide"], expose=spec["expose"], limits=limits,
                      on_pid=lambda pid: _send(sock, {"pid": pid}),
                      seccomp=spec["seccomp"], deny=deny)  # fmt: skip
        isolation = {
            "sandbox": True,
            **{k: v for k, v in sandbox.STATUS.items() if k != "open_fds"},
        }
    else:
        _limit(spec)
        _send(sock, {"pid": os.getpid()})
        # Still no fork or exec: a helper process's CPU time is not this process's, so it
        # would compute outside the clock (an attacker's helper was credited 3.3-4.1x).
        try:
            why = sandbox.filter_syscalls(deny) if spec["seccomp"] else "not requested"
        except sandbox.SandboxError as e:  # a kernel without seccomp filters: said, not fatal
            why = str(e)
        isolation = {"sandbox": False, "seccomp": why or "installed"}
    # Where the evaluator can read this process's memory (how it takes every output): a known
    # pattern, read back before any candidate code runs.
    from wanka.lab.shm import PROBE, describe

    probe_meta, probe = describe(PROBE.clone())
    _send(sock, {"probe": probe_meta})
    if device == "cpu":
        _warm_heap()  # before the lockdown, which denies ctypes
    _lockdown(jobdir, compilers=device == "cuda")
    peaks = measure_peaks(device)  # in every server: the same allocator and library state
    serve = make_serve(sock, buf, spec, peaks)
    for name, text in untrusted.items():
        try:  # under a name of its own: `__name__ == "candidate"` must not tell it is tested
            module = f"kernel_{os.urandom(6).hex()}"
            kernels[name] = load_source(text, module, f"{name}.py").kernel
        except BaseException as e:  # noqa: BLE001  (a candidate may raise anything at import)
            _send(sock, {"ready": False, "status": "import_error",
                         "message": f"{type(e).__name__}: {e}"[:2000],
                         "traceback": _trim(traceback.format_exc())})  # fmt: skip
            return
    _send(sock, {"ready": True, "isolation": isolation})
    serve(kernels)
