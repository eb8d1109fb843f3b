"""`wanka bench cp --replay`: each rank's share replayed alone with a stand-in gather. The
stand-in must give the gathered buffer's real shape, the replay must run exactly the plan's
pieces, and a rank that reads no remote key must compute what the model computes."""

import numpy as np
import pytest
import torch

from wanka.bench.cp_replay import StandInLayout, build_model, replay_step
from wanka.bench.cp_worker import packed_batch
from wanka.cli import main
from wanka.config.schema import ModelConfig
from wanka.distributed.cp_cost import CostModel

TINY = {"dim": 32, "n_layers": 2, "n_heads": 2, "head_dim": 16, "n_index_heads": 1,
        "index_head_dim": 8, "index_topk": 16, "n_experts": 4, "n_active_experts": 2,
        "expert_hidden": 32, "max_seq_len": 256}  # fmt: skip


def test_stand_in_gather_is_the_gathered_shape_and_its_backward_sums_the_tiles():
    x = torch.randn(1, 3, 2, requires_grad=True)
    lay = StandInLayout(group=None, Lmax=5, segments=[], needs_gather=True, sparse=True, span=4)
    out = lay.gather(x)
    assert out.shape == (1, 20, 2)  # [B, span * Lmax, ...] as the all-gather's output
    # Every key distinct (a prefix read across tiles must not hold one key twice: ties).
    assert len(set(out.flatten().tolist())) == 40
    assert lay.gather(x).equal(out)  # fixed noise: every layer's stand-in alike
    out.sum().backward()
    assert x.grad.eq(4).all()
    off = StandInLayout(group=None, Lmax=5, segments=[], needs_gather=False, sparse=True)
    assert off.gather(x) is x


@pytest.mark.parametrize("layout", ["contiguous", "head_tail", "dynamic"])
def test_replay_runs_every_rank_on_exactly_the_plans_pieces(layout):
    torch.manual_seed(0)
    cfg = ModelConfig(**TINY, mtp_depth=1)
    model = build_model(cfg)
    rows = [[100, 28], [10, 7, 111]]  # dp 2 groups of one 128-token row, 5 documents
    recs = replay_step(model, cfg, packed_batch(rows, cfg.vocab_size, 0), dp=2, cp=2,
                       layout=layout, cost=CostModel(topk=16), repeats=2)  # fmt: skip
    assert [r["rank"] for r in recs] == [0, 1, 2, 3]
    assert sum(r["tokens"] for r in recs) == 256
    for r in recs:
        assert len(r["repeats_s"]) == 2 and r["compute_s"] == min(r["repeats_s"]) > 0
        assert r["terms"][0] == r["tokens"] and r["span"] in (2, 4)
    # However the layout cuts documents, the ranks' pieces hold each document's pairs once.
    whole = CostModel(topk=16).terms(0, np.array([100, 28, 10, 7, 111]))
    assert [sum(r["terms"][i] for r in recs) for i in range(3)] == [int(t.sum()) for t in whole]
    assert all(p.grad is None for p in model.parameters())  # zeroed after each run


def test_a_rank_that_reads_no_remote_key_computes_the_models_loss():
    """Contiguous, one document over cp 2: rank 0 holds its first half and attends only to it,
    so the stand-in's values are never read and its loss is the model's on that half."""
    torch.manual_seed(0)
    cfg = ModelConfig(**TINY, mtp_depth=0)
    model = build_model(cfg)
    batch = packed_batch([[128]], cfg.vocab_size, 3)
    seen = []
    real_forward = model.forward

    def spy(*args, **kwargs):
        parts = real_forward(*args, **kwargs)
        seen.append(float(parts.lm_sum.detach()))
        return parts

    model.forward = spy
    replay_step(model, cfg, batch, dp=1, cp=2, layout="contiguous", cost=CostModel(topk=16),
                repeats=1)  # fmt: skip
    model.forward = real_forward
    with torch.no_grad():
        ref = model(batch.tokens[:, :64], batch.positions[:, :64], batch.doc_ids[:, :64],
                    batch.labels[:, :64], phase="sparse")  # fmt: skip
    assert seen[0] == pytest.approx(float(ref.lm_sum), rel=1e-5)
    assert seen[1] != pytest.approx(seen[0], rel=1e-3)  # rank 1: other tokens, other loss


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--repeats", "2"], "--repeats counts the runs of each rank under --replay"),
        (["--replay", "--simulate"], "pick one of them"),
        (["--replay", "--repeats", "0"], "--repeats must be 1 or more"),
    ],
)
def test_replay_flag_errors_are_one_line_exit_2(tmp_path, capsys, argv, fragment):
    out = tmp_path / "o.json"
    assert main(["bench", "cp", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err
    assert not out.exists()
