"""HSDP degrees and communication options: what ParallelDims and the config accept, and the
one-line errors they give."""

import pytest

from wanka.config import ConfigError, load_config
from wanka.distributed.parallel_dims import ParallelDims, ParallelError


def test_replicas_split_the_batch_and_shard_inside():
    d = ParallelDims.resolve(-1, 2, 8, cp=2, dp_replicate=2)
    assert (d.dp_replicate, d.dp_shard, d.cp) == (2, 2, 2)
    assert d.dp == 4 and d.replica_size == 4 and d.dp_mod_ep == 2
    assert d.hsdp_enabled
    assert not ParallelDims.resolve(-1, 1, 8).hsdp_enabled


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"dp_replicate": 3}, "must divide the world size 8"),
        ({"dp_replicate": 0}, "dp_replicate=0 must be positive"),
        ({"dp_replicate": 2, "dp_shard": 2}, "does not match the world size 8"),
        ({"dp_replicate": 4, "ep": 4}, "inside one HSDP replica"),
    ],
)
def test_bad_hsdp_degrees_name_the_field(kw, needle):
    args = {"dp_shard": -1, "ep": 1, "world_size": 8, **kw}
    with pytest.raises(ParallelError, match=needle):
        ParallelDims.resolve(**args)


def test_ep_spans_nodes_only_across_whole_nodes():
    d = ParallelDims.resolve(-1, 4, 8)
    for per_node, spans in ((2, True), (4, False), (8, False), (3, False), (0, False)):
        d.ranks_per_node = per_node
        assert d.ep_spans_nodes is spans, per_node


def test_config_checks_comm_fields():
    with pytest.raises(ConfigError, match="parallel.dp_replicate=1"):
        load_config(None, ["comm.grad_compression=int8"])
    with pytest.raises(ConfigError, match="comm.grad_compression"):
        load_config(None, ["comm.grad_compression=fp8", "parallel.dp_replicate=2"])
    with pytest.raises(ConfigError, match="comm.powersgd_rank"):
        load_config(None, ["comm.powersgd_rank=0", "parallel.dp_replicate=2"])
    with pytest.raises(ConfigError, match="comm.expert_a2a"):
        load_config(None, ["comm.expert_a2a=tree"])
    cfg = load_config(None, ["parallel.dp_replicate=2", "comm.grad_compression=powersgd"])
    assert cfg.comm.powersgd_rank == 4 and cfg.comm.expert_a2a == "flat"
