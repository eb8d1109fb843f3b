"""The process-group backend on an accelerator must also carry CPU tensors: the trainer, the
pre-flight, snapshots and metrics all-reduce small host tensors."""

import pytest
import torch
import torch.distributed as dist

from tests.distributed.helpers import free_port
from wanka.device import dist_backend


@pytest.mark.parametrize("device_type", ["cuda", "npu"])
def test_accelerator_backend_map_covers_cpu_tensors(device_type):
    mapping = dict(part.split(":") for part in dist_backend(device_type).split(","))
    assert mapping["cpu"] == "gloo"
    assert mapping[device_type] == {"cuda": "nccl", "npu": "hccl"}[device_type]


def test_cpu_backend():
    assert dist_backend("cpu") == "cpu:gloo"


def test_a_map_without_cpu_cannot_carry_host_tensors_but_ours_can(monkeypatch):
    """The class of bug, reproduced on CPU: a group whose map names only another device type
    ("meta" stands in for the accelerator) refuses CPU tensors; the map dist_backend builds for
    an accelerator (accelerator backend swapped for gloo here) reduces them, on sub-groups too."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for backend, works in (("meta:gloo", False), (dist_backend("cuda").replace("cuda:nccl", "meta:gloo"), True)):  # fmt: skip
        dist.init_process_group(backend, rank=0, world_size=1)
        try:
            t = torch.ones(2)
            if works:
                dist.all_reduce(t)
                sub = dist.new_group([0])
                dist.all_reduce(t, group=sub)
                assert t.tolist() == [1.0, 1.0]
            else:
                with pytest.raises(RuntimeError, match="device type cpu"):
                    dist.all_reduce(t)
        finally:
            dist.destroy_process_group()
