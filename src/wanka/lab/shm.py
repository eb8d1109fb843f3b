"""Tensors between the evaluator and its kernel servers, through one shared-memory file per
server: the evaluator writes a call's inputs, the server writes the outputs it returned.

Only JSON crosses the socket (never pickle: the evaluator must not unpickle anything a
candidate's process produced). A tensor travels as {"dtype", "shape", "offset"} into the
buffer; `get` validates every field, so a forged description reads as an error, never as
memory outside the buffer.
"""

from __future__ import annotations

import math
import os
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

    def another_mapping(self) -> Buffer:
        """The same file mapped again: writes through it are seen here, but bump no version
        counter of this mapping's views (autograd checks those of inputs saved for backward)."""
        return Buffer(self.path, self.nbytes)

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
        if not isinstance(meta, dict) or set(meta) != {"dtype", "shape", "offset"}:
            raise ShmError(f"malformed tensor description {str(meta)[:80]!r}")
        name, shape, off = meta["dtype"], meta["shape"], meta["offset"]
        dtype = DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None or not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise ShmError(f"malformed tensor description {str(meta)[:80]!r}")
        if not all(type(d) is int and 0 <= d < 2**40 for d in shape):
            raise ShmError(f"malformed shape {str(shape)[:80]}")
        if type(off) is not int or off < 0 or off % ALIGN:
            raise ShmError(f"malformed offset {off!r}")
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if off + n > self.nbytes:
            raise ShmError("tensor description points outside the buffer")
        return self.view(off, dtype, shape)


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
