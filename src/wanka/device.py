"""The one place that knows about device kinds (cpu / cuda / npu) and their backends."""

from __future__ import annotations

import ctypes
import importlib.util
import os

import torch


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers the "npu" device with torch)

    return torch.npu.is_available()


def resolve_device_type(requested: str = "auto") -> str:
    """'auto' picks an accelerator when one is present, else the CPU."""
    if requested != "auto":
        if requested == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                "run.device='cuda' but no CUDA device is visible: set run.device='cpu'"
            )
        if requested == "npu" and not npu_available():
            raise ValueError(
                "run.device='npu' but torch_npu/NPU is unavailable: set run.device='cpu'"
            )
        return requested
    if torch.cuda.is_available():
        return "cuda"
    if npu_available():
        return "npu"
    return "cpu"


ACCELERATOR_BACKENDS = {"cuda": "nccl", "npu": "hccl"}


def dist_backend(device_type: str) -> str:
    """The process-group backend as a device-to-backend map. On an accelerator the map also
    names gloo for CPU tensors: small host-side collectives (target counts, loss sums,
    expert loads, pre-flight probes, metrics) then work beside the accelerator's backend
    instead of failing with "No backend type associated with device type cpu"."""
    accel = ACCELERATOR_BACKENDS.get(device_type)
    return f"cpu:gloo,{device_type}:{accel}" if accel else "cpu:gloo"


def local_device(device_type: str) -> torch.device:
    """The device this rank computes on (accelerators: one per local rank)."""
    if device_type == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    getattr(torch, device_type).set_device(local_rank)
    return torch.device(device_type, local_rank)


def autocast_dtype(device_type: str, mode: str) -> torch.dtype | None:
    """The compute dtype: bf16 on accelerators by default, None (fp32) on CPU. parallelize
    applies it through FSDP's mixed-precision policy (no autocast)."""
    if mode == "fp32" or (mode == "auto" and device_type == "cpu"):
        return None
    return torch.bfloat16


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak allocated bytes on an accelerator; None on CPU (use process RSS there)."""
    if device.type == "cpu":
        return None
    return getattr(torch, device.type).max_memory_allocated(device)


def keep_freed_host_memory() -> None:
    """glibc returns large freed blocks to the kernel and maps them again on the next step, so
    a CPU step pays page faults its work does not need (kernel time that also varies run to
    run on a shared VM). Fixed thresholds keep freed blocks in the heap, as a long-running
    process reaches anyway; blocks above 32 MiB (glibc's ceiling) are still mapped per use.
    A no-op where the C library is not glibc, where the environment sets glibc's own malloc
    options (MALLOC_*_ or GLIBC_TUNABLES: `wanka bench memory` pins a low mmap threshold so
    RSS follows the allocations), or with WANKA_HOST_MALLOC=default (to compare:
    benchmarks/host_malloc_ab.py)."""
    if os.environ.get("WANKA_HOST_MALLOC", "") == "default" or any(
        k == "GLIBC_TUNABLES" or (k.startswith("MALLOC_") and k.endswith("_")) for k in os.environ
    ):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD: never trim the heap
    except (OSError, AttributeError):
        pass
