"""`wanka bench cp --replay`: each rank's share replayed alone, its gathers answered with the
real keys captured from all ranks in lockstep. The replay must compute each rank's exact share
of the loss, run exactly the plan's pieces, and plan with the live ranks' gather spans."""

import numpy as np
import pytest
import torch

from wanka.bench.cp_replay import replay_step
from wanka.bench.cp_worker import build_model, packed_batch
from wanka.cli import main
from wanka.config.schema import ModelConfig
from wanka.distributed.cp_cost import CostModel

TINY = {"dim": 32, "n_layers": 2, "n_heads": 2, "head_dim": 16, "n_index_heads": 1,
        "index_head_dim": 8, "index_topk": 16, "n_experts": 4, "n_active_experts": 2,
        "expert_hidden": 32, "max_seq_len": 256}  # fmt: skip


@pytest.mark.parametrize("layout", ["contiguous", "head_tail", "dynamic"])
def test_replayed_ranks_compute_the_unsharded_loss(layout):
    """Each replayed rank reads the real keys of the others (captured in lockstep), so its
    losses are its exact share: summed over the ranks they are one process's on the rows."""
    torch.manual_seed(0)
    cfg = ModelConfig(**TINY, mtp_depth=1)
    model = build_model(cfg)
    batch = packed_batch([[100, 28], [10, 7, 111]], cfg.vocab_size, 0)
    timed = []
    real_forward = model.forward

    def spy(*args, **kwargs):
        parts = real_forward(*args, **kwargs)
        if torch.is_grad_enabled():  # the timed passes (the capture runs without grad)
            timed.append((float(parts.lm_sum.detach()), float(parts.mtp_sum.detach())))
        return parts

    model.forward = spy
    recs = replay_step(model, cfg, batch, dp=2, cp=2, layout=layout, cost=CostModel(topk=16),
                       repeats=2)  # fmt: skip
    model.forward = real_forward
    with torch.no_grad():
        ref = model(batch.tokens, batch.positions, batch.doc_ids, batch.labels, phase="sparse")
    assert len(timed) == 4 * 2 and [r["rank"] for r in recs] == [0, 1, 2, 3]
    first = timed[:4]  # each rank's first repeat (repeats come rank by rank, one after another)
    assert timed[4:] == first  # a repeat computes the same thing again
    assert sum(x[0] for x in first) == pytest.approx(float(ref.lm_sum), rel=1e-5)
    assert sum(x[1] for x in first) == pytest.approx(float(ref.mtp_sum), rel=1e-5)


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


def test_replay_plans_with_the_live_ranks_gather_spans():
    """cp = 1 has no gather groups: the live CPSharder never widens, nor may the replay (one
    long row in one dp group would otherwise spread over both)."""
    cfg = ModelConfig(**TINY, mtp_depth=0)
    model = build_model(cfg)
    batch = packed_batch([[128], [10, 7, 111]], cfg.vocab_size, 0)
    recs = replay_step(model, cfg, batch, dp=2, cp=1, layout="dynamic", cost=CostModel(topk=16),
                       repeats=1)  # fmt: skip
    assert [r["span"] for r in recs] == [1, 1]
    assert sorted(r["tokens"] for r in recs) == [128, 128]  # the 128-token document stays whole


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--repeats", "2"], "--repeats counts the runs of each rank under --replay"),
        (["--replay", "--simulate"], "pick one of them"),
        (["--replay", "--repeats", "0"], "--repeats must be 1 or more"),
        (["--simulate", "--repeats", "2"], "--repeats counts the runs of each rank under --replay"),
    ],
)
def test_replay_flag_errors_are_one_line_exit_2(tmp_path, capsys, argv, fragment):
    out = tmp_path / "o.json"
    assert main(["bench", "cp", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err
    assert not out.exists()


def test_timed_runs_interleave_layouts_rank_by_rank(monkeypatch):
    """A slow spell of a shared machine must land on every layout alike: the timed runs go
    rank by rank with all layouts in turn, repeat after repeat (not one layout's block)."""
    from wanka.bench import cp_replay

    cfg = ModelConfig(**TINY, mtp_depth=0)
    model = build_model(cfg)
    calls = []
    real = cp_replay._forward_backward
    monkeypatch.setattr(cp_replay, "_forward_backward",
                        lambda m, local, lay: (calls.append((lay.rank, id(lay.captured))),
                                               real(m, local, lay)))  # fmt: skip
    layouts = ["contiguous", "head_tail", "dynamic"]
    got = cp_replay.replay_steps(model, cfg, packed_batch([[100, 28], [10, 7, 111]], 256, 0),
                                 2, 2, layouts, CostModel(topk=16), repeats=2)  # fmt: skip
    assert list(got) == layouts and len(calls) == 2 * 4 * 3
    for i in range(0, len(calls), 3):
        ranks, lays = zip(*calls[i : i + 3])
        assert len(set(ranks)) == 1 and len(set(lays)) == 3  # one rank, every layout
    assert [c[0] for c in calls[::3]] == [0, 1, 2, 3, 0, 1, 2, 3]
    for recs in got.values():
        assert all(len(r["repeats_s"]) == 2 for r in recs)
