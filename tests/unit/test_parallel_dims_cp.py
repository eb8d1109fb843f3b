"""Context-parallel degrees: what ParallelDims accepts and the one-line errors it gives."""

import pytest

from wanka.config import ConfigError, load_config
from wanka.distributed.parallel_dims import ParallelDims, ParallelError


def test_dp_is_what_cp_leaves_and_ep_borrows_from_dp_x_cp():
    d = ParallelDims.resolve(-1, 4, 8, cp=2)
    assert (d.dp_shard, d.cp, d.ep, d.dp_mod_ep) == (4, 2, 4, 2)
    assert d.cp_enabled and d.ep_enabled
    assert ParallelDims.resolve(-1, 2, 2, cp=2).dp_shard == 1  # ep may span the CP group


@pytest.mark.parametrize(
    "args,needle",
    [
        ((-1, 1, 4, 3), "must divide the world size 4"),
        ((-1, 1, 4, 0), "must be positive"),
        ((4, 1, 4, 2), "does not match the world size 4"),
        ((-1, 3, 4, 2), "must divide parallel.dp_shard x parallel.cp = 4"),
    ],
)
def test_bad_degrees_name_the_field(args, needle):
    with pytest.raises(ParallelError, match=needle):
        ParallelDims.resolve(*args[:3], cp=args[3])


def test_config_checks_cp_fields():
    with pytest.raises(ConfigError, match="parallel.cp_layout"):
        load_config(None, ["parallel.cp_layout=zigzag"])
    with pytest.raises(ConfigError, match="does not divide data.seq_len"):
        load_config(None, ["parallel.cp=3", "parallel.cp_layout=contiguous", "data.seq_len=256"])
    for unsupported in ("train.activation_checkpointing=full", "train.compile=true"):
        with pytest.raises(ConfigError, match="not supported with parallel.cp > 1"):
            load_config(None, ["parallel.cp=2", unsupported])
    cfg = load_config(None, ["parallel.cp=3", "data.seq_len=256"])  # dynamic: any cp
    assert cfg.parallel.cp == 3 and cfg.parallel.cp_layout == "dynamic"


def test_cp_cost_file_is_read_or_refused_in_one_line(tmp_path):
    from wanka.train.trainer import _cp_cost

    cfg = load_config(None, ["parallel.cp=2", "model.index_topk=64"])
    assert _cp_cost(cfg).topk == 64  # the built-in estimate follows the model's k
    good = tmp_path / "cp.json"
    good.write_text('{"cost_model": {"linear": 1e-4, "sparse": 2e-6, "dense": 3e-8, "topk": 64}}')
    cfg = load_config(None, ["parallel.cp=2", f'parallel.cp_cost="{good}"'])
    assert _cp_cost(cfg).sparse == 2e-6
    junk = tmp_path / "junk.json"
    junk.write_text("[1, 2]")
    cases = ((tmp_path / "none.json", "no such file"), (tmp_path, "cannot read"), (junk, "not a"))
    for bad, needle in cases:
        cfg = load_config(None, ["parallel.cp=2", f'parallel.cp_cost="{bad}"'])
        with pytest.raises(ConfigError, match=f"parallel.cp_cost.*{needle}"):
            _cp_cost(cfg)
