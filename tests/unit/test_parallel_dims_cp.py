"""Context-parallel degrees: what ParallelDims accepts and the one-line errors it gives."""

import pytest

from wanka.config import ConfigError, load_config
from wanka.distributed.cp_cost import CostModel
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
    assert cfg.parallel.cp_max_span == 0  # any span
    for bad in ("1", "-4"):
        with pytest.raises(ConfigError, match="parallel.cp_max_span.*below parallel.cp=2"):
            load_config(None, ["parallel.cp=2", f"parallel.cp_max_span={bad}"])
    assert load_config(None, ["parallel.cp=2", "parallel.cp_max_span=4"]).parallel.cp_max_span == 4


def test_cp_cost_file_is_read_or_refused_in_one_line(tmp_path):
    from wanka.train.trainer import _cp_cost

    cfg = load_config(None, ["parallel.cp=2", "model.index_topk=64"])
    assert _cp_cost(cfg).topk == 64  # the built-in estimate follows the model's k
    good = tmp_path / "cp.json"
    good.write_text('{"cost_model": {"linear": 1e-4, "sparse": 2e-6, "dense": 3e-8, "topk": 64}}')
    cfg = load_config(None, ["parallel.cp=2", f'parallel.cp_cost="{good}"'])
    assert _cp_cost(cfg).sparse == 2e-6
    assert _cp_cost(cfg).gather == CostModel().gather  # not in the file: the built-in estimate
    good.write_text('{"linear": 1e-4, "sparse": 2e-6, "dense": 3e-8, "topk": 64, "gather": 0}')
    assert _cp_cost(cfg).gather == 0.0  # a file may set it (0: gathers are free)
    other_k = load_config(
        None, ["parallel.cp=2", "model.index_topk=32", f'parallel.cp_cost="{good}"']
    )
    assert _cp_cost(other_k).topk == 32  # pairs counted up to this model's k, not the file's
    negative = tmp_path / "neg.json"
    negative.write_text('{"linear": 1e-4, "sparse": 0, "dense": 0, "topk": 64, "gather": -1}')
    with pytest.raises(ConfigError, match="parallel.cp_cost.*not a"):
        _cp_cost(load_config(None, ["parallel.cp=2", f'parallel.cp_cost="{negative}"']))
    junk = tmp_path / "junk.json"
    junk.write_text("[1, 2]")
    cases = ((tmp_path / "none.json", "no such file"), (tmp_path, "cannot read"), (junk, "not a"))
    for bad, needle in cases:
        cfg = load_config(None, ["parallel.cp=2", f'parallel.cp_cost="{bad}"'])
        with pytest.raises(ConfigError, match=f"parallel.cp_cost.*{needle}"):
            _cp_cost(cfg)


def test_cp_sharder_without_gather_groups_plans_whole_documents():
    """cp = 1 (no gather groups): every rank of dp 2 takes whole documents, nothing gathered."""
    import torch

    from wanka.data.loader import Batch
    from wanka.distributed.context_parallel import CPSharder

    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1]])
    tokens = torch.arange(16).reshape(2, 8)
    rows = Batch(tokens, tokens + 1, torch.zeros_like(tokens), doc_ids)
    got = []
    for dp_rank in (0, 1):
        shard = CPSharder(2, 1, dp_rank, 0, {}, "dynamic", 0, True)
        assert shard.max_span == 1
        local, layout = shard(rows)
        assert not layout.needs_gather and layout.group is None
        got += local.tokens.flatten().tolist()
    assert sorted(got) == list(range(16))


def test_cp_cost_profile_is_used_at_its_own_topk_only(tmp_path):
    """A position profile's shape is that of the top-k it was measured at (its cost climbs to
    about 1.5 x k): carried over to another k it would plan silently wrong."""
    from wanka.train.trainer import _cp_cost

    prof = tmp_path / "profile.json"
    prof.write_text('{"cost_model": {"linear": 0, "sparse": 0, "dense": 0, "topk": 64, '
                    '"profile": [1e-4, 3e-4], "profile_bin": 32}}')  # fmt: skip
    same = load_config(None, ["parallel.cp=2", "model.index_topk=64", f'parallel.cp_cost="{prof}"'])
    assert _cp_cost(same).profile == (1e-4, 3e-4)
    other = load_config(
        None, ["parallel.cp=2", "model.index_topk=32", f'parallel.cp_cost="{prof}"']
    )
    with pytest.raises(
        ConfigError, match="parallel.cp_cost.*index_topk 64.*bench cp --index-topk 32"
    ):
        _cp_cost(other)
