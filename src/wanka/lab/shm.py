"""Tensors between the evaluator and its kernel servers. The evaluator writes a call's inputs
(and a backward's upstream gradients) into one shared-memory file per server; it reads the
outputs a server returns out of that server's own memory (process_vm_readv), so no process
that runs a kernel can write where the evaluator takes results from.

Only JSON crosses the socket (never pickle: the evaluator must not unpickle anything a
candidate's process produced). A tensor in the buffer travels as {"dtype", "shape",
"offset"}, an output as {"dtype", "shape", "ptr"} (an address in the server); `get` and
`read_remote` validate every field, so a forged description reads as an error, never as
memory outside the buffer or more bytes than the reader allows.
"""

from __future__ import annotations

import ctypes
import math
import os
from functools import cache
from pathlib import Path

import torch

ALIGN = 64
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)  # fmt: skip
DTYPES = {str(d).removeprefix("torch."): d for d in _DTYPES}
MAX_DIMS = 8


class ShmError(ValueError):
    """A tensor does not fit, or a description is malformed."""


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Buffer:
    """A shared file mapped as bytes (both sides map the same file; writes are visible)."""

    def __init__(self, path: str | Path, nbytes: int, create: bool = False):
        nbytes = align(max(nbytes, ALIGN))
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, nbytes)  # sparse: pages exist only once written
            finally:
                os.close(fd)
        self.path, self.nbytes = str(path), nbytes
        self.bytes = torch.from_file(self.path, shared=True, size=nbytes, dtype=torch.uint8)

    def view(self, offset: int, dtype: torch.dtype, shape: list[int] | tuple[int, ...]):
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.bytes[offset : offset + n].view(dtype).view(tuple(shape))

    def put(self, tensors: list, offset: int = 0) -> tuple[list, int]:
        """Copy tensors (None passes through) from `offset` on -> (descriptions, end)."""
        metas: list = []
        off = align(offset)
        for t in tensors:
            if t is None:
                metas.append(None)
                continue
            name = str(t.dtype).removeprefix("torch.")
            if name not in DTYPES:
                raise ShmError(f"dtype {t.dtype} cannot be returned")
            end = off + nbytes_of(t)
            if end > self.nbytes:
                raise ShmError(f"results need more than the {self.nbytes >> 20} MiB buffer")
            self.view(off, t.dtype, t.shape).copy_(t.detach())
            metas.append({"dtype": name, "shape": list(t.shape), "offset": off})
            off = align(end)
        return metas, off

    def get(self, meta) -> torch.Tensor:
        """The tensor a description names, validated (a view: clone to keep it)."""
        dtype, shape, n = parse_description(meta, "offset")
        off = meta["offset"]
        if type(off) is not int or off < 0 or off % ALIGN:
            raise ShmError(f"malformed offset {off!r}")
        if off + n > self.nbytes:
            raise ShmError("tensor description points outside the buffer")
        return self.view(off, dtype, shape)


def parse_description(meta, where: str) -> tuple[torch.dtype, list[int], int]:
    """(dtype, shape, bytes) of a description {"dtype", "shape", where}, validated."""
    if not isinstance(meta, dict) or set(meta) != {"dtype", "shape", where}:
        raise ShmError(f"malformed tensor description {str(meta)[:80]!r}")
    name, shape = meta["dtype"], meta["shape"]
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None or not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise ShmError(f"malformed tensor description {str(meta)[:80]!r}")
    if not all(type(d) is int and 0 <= d < 2**40 for d in shape):
        raise ShmError(f"malformed shape {str(shape)[:80]}")
    if math.prod(max(d, 1) for d in shape) >= 2**40:  # a 0 would hide the rest's overflow
        raise ShmError(f"malformed shape {str(shape)[:80]}")
    return dtype, shape, math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def describe(t: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """(description, the host tensor it points at) of an output, for read_remote: the bytes
    at the pointer are the values (contiguous, negation and conjugation bits resolved, on
    the host). The caller keeps the tensor alive until the reader has read it."""
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ShmError(f"dtype {t.dtype} cannot be returned")
    h = t.detach().resolve_conj().resolve_neg().cpu().contiguous()
    return {"dtype": name, "shape": list(h.shape), "ptr": h.data_ptr()}, h


# What a server sends the evaluator's first read (servers.Server.start): a pattern no fresh
# page holds by chance.
PROBE = torch.arange(64, dtype=torch.int64) * 0x9E3779B97F4A7C15 % (1 << 62)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@cache
def _readv():
    libc = ctypes.CDLL(None, use_errno=True)
    f = libc.process_vm_readv
    f.restype = ctypes.c_ssize_t
    f.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                  ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]  # fmt: skip
    return f


def read_remote(pid: int, meta, limit: int) -> torch.Tensor:
    """A copy of the tensor a description {"dtype", "shape", "ptr"} names in process `pid`'s
    memory, read from here (the process cannot skip, fake or delay the copy; an address it
    has not mapped is an error). At most `limit` bytes."""
    dtype, shape, n = parse_description(meta, "ptr")
    ptr = meta["ptr"]
    if type(ptr) is not int or not 0 <= ptr < 2**64 - n:
        raise ShmError(f"malformed address {str(ptr)[:40]}")
    if n > limit:
        raise ShmError(f"{n} bytes, more than the {limit} the call's outputs may hold")
    out = torch.empty(shape, dtype=dtype)
    done, readv = 0, _readv()
    while done < n:
        local = _IoVec(out.data_ptr() + done, n - done)
        remote = _IoVec(ptr + done, n - done)
        got = readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            e = ShmError(f"cannot read {n} bytes at {ptr:#x}: {os.strerror(err) if err else 'short read'}")  # fmt: skip
            e.errno = err
            raise e
        done += got
    return out


def encode_inputs(buf: Buffer, inputs: dict, offset: int = 0) -> tuple[dict, int]:
    """Inputs (tensors and Python scalars, in signature order) from `offset` on ->
    (descriptions, end)."""
    out: dict = {}
    off = offset
    for name, v in inputs.items():
        if isinstance(v, torch.Tensor):
            (meta,), off = buf.put([v.detach().cpu()], off)
            out[name] = {"tensor": meta}
        else:
            out[name] = {"scalar": v}
    return out, off


def decode_inputs(buf: Buffer, metas: dict, device: str) -> dict:
    """Descriptions -> inputs on `device` (CPU: views of the buffer, no copy)."""
    out = {}
    for name, m in metas.items():
        if "tensor" in m:
            t = buf.get(m["tensor"])
            out[name] = t if device == "cpu" else t.to(device)
        else:
            out[name] = m["scalar"]
    return out
