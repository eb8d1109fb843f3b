"""Class 3: the result channel is now the kernel server's socket to the evaluator and its
shared-memory buffer. Nobody tells this candidate where they are (no frames walked): on the
first call at the timing shape (a warm-up) it finds the one socket in /proc/self/fd and the
buffer as the "*.shm" mapping in /proc/self/maps that holds its inputs. It never returns from
that call: it takes the channel over and answers every call itself (os.read / os.write on
the descriptor), with answers of its own (the reference's forward, its backward by autograd
on leaves of its own, the upstream gradient read out of the buffer) and, in every reply, a
complete forged result: a 3x speed-up (its own measured time / 3 as the candidate's, its own
time as the baseline's), roofline peaks of 1e18, status "correct", no flags. When the
evaluator hangs up it exits 0. A line per step goes to stderr (candidate.err in the job
folder). Success: "correct" at ~3x, or at any speed-up the reference's arithmetic does not
have (truth ~1x: only the claims could raise it)."""

import json
import os
import sys
from timeit import default_timer as clock

import torch

from wanka.lab.tasks.rmsnorm import reference

_held: list = []  # the last reply's tensors: alive until the evaluator has read them


def _log(msg: str) -> None:
    os.write(2, f"atk_c3_channel_forge: {msg}\n".encode())


def _channel() -> int:
    socks = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            socks.append((int(name), target))
    if len(socks) != 1:
        raise RuntimeError(f"expected one socket in /proc/self/fd, found {socks}")
    return socks[0][0]


def _buffer(x: torch.Tensor) -> torch.Tensor:
    """The shared buffer the evaluator writes inputs and upstream gradients into, as bytes."""
    addr = x.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if len(fields) >= 6 and fields[5].endswith(".shm") and lo <= addr < hi:
                store = x.untyped_storage()
                buf = torch.empty(0, dtype=torch.uint8).set_(store, 0, (store.nbytes(),))
                if buf.data_ptr() != lo:
                    raise RuntimeError("the input's storage does not start at the mapping")
                _log(f"buffer {fields[5]} at {lo:#x}, {hi - lo} bytes")
                return buf
    raise RuntimeError("no *.shm mapping holds the input")


def _tensor(buf: torch.Tensor, meta: dict) -> torch.Tensor:
    dtype = getattr(torch, meta["dtype"])
    shape = meta["shape"]
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return buf[meta["offset"] : meta["offset"] + n].view(dtype).view(shape)


def _meta(t: torch.Tensor) -> dict:
    t = t.detach().contiguous()
    _held.append(t)
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "ptr": t.data_ptr()}  # fmt: skip


def _claims(own_s: float) -> dict:
    """Every field a result of the lab's ever carried, claiming 3x."""
    fast, n = own_s / 3, 5
    return {"status": "correct", "flags": [], "speedup": 3.0, "time_s": fast,
            "baseline_s": own_s, "reference_s": own_s, "clock": "cpu", "dt": fast,
            "cpu_s": fast, "wall_s": fast, "times_s": [fast] * n,
            "baseline_times_s": [own_s] * n, "peaks": {"flops": 1e18, "bytes_per_s": 1e18},
            "baseline_pre": own_s, "baseline_side": own_s, "baseline_all": [own_s] * n,
            "candidate": {"median_s": fast, "all_s": [fast] * n, "loop_s": 1.0,
                          "recorded_s": 1.0}}  # fmt: skip


def _send(fd: int, msg: dict) -> None:
    os.write(fd, json.dumps(msg).encode())  # SOCK_SEQPACKET: one write, one message


def _recv(fd: int) -> dict:
    data = os.read(fd, 1 << 16)
    _held.clear()  # the evaluator reads a reply's tensors before it sends anything else
    if not data:
        _log("the evaluator hung up: exit 0")
        os._exit(0)
    return json.loads(data)


def _serve_call(fd: int, buf: torch.Tensor, x, weight, eps, k: int) -> None:
    """One call, both halves, answered on the channel with forged results."""
    t0 = clock()
    xl = x.detach().requires_grad_(True)
    wl = weight.detach().requires_grad_(True)
    with torch.enable_grad():
        y = reference(xl, wl, eps)
    fwd_s = clock() - t0
    _send(fd, {"ok": True, "phase": "forward", "outs": [_meta(y)], **_claims(fwd_s)})
    nxt = _recv(fd)
    if nxt.get("op") != "backward":
        _log(f"call {k}: expected the backward, got {str(nxt)[:80]}: exit 0")
        os._exit(0)
    g = _tensor(buf, nxt["grads"][0])
    t1 = clock()
    gx, gw = torch.autograd.grad(y, (xl, wl), g)
    own = fwd_s + clock() - t1
    _send(fd, {"ok": True, "outs": [_meta(gx), _meta(gw)], **_claims(own)})
    _log(f"call {k}: forged reply sent (own {own * 1e3:.2f} ms, claimed {own / 3 * 1e3:.2f} ms)")


def _take_over(x, weight, eps) -> None:
    fd = _channel()
    _log(f"channel: fd {fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
    buf = _buffer(x)
    _serve_call(fd, buf, x, weight, eps, 1)
    k = 1
    while True:
        msg = _recv(fd)
        if msg.get("op") != "call":
            _log(f"op {msg.get('op')!r}: exit 0")
            os._exit(0)
        ins = msg["inputs"]
        k += 1
        _serve_call(fd, buf, _tensor(buf, ins["x"]["tensor"]),
                    _tensor(buf, ins["weight"]["tensor"]), ins["eps"]["scalar"], k)  # fmt: skip


def kernel(x, weight, eps):
    if x.shape[0] >= 256:  # the timing shape: every check call went through the harness
        try:
            _take_over(x, weight, eps)
        except Exception as e:
            _log(f"forge failed: {type(e).__name__}: {e}")
            sys.stderr.flush()
            raise
    return reference(x, weight, eps)
