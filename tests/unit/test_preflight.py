"""Static pre-flight checks: every broken job names its fix on a FAIL line; a sound one passes.
The collation of live records (links, burn-in, memory) is tested here on synthetic records;
tests/distributed/test_preflight_live.py runs the real ranks."""

from __future__ import annotations

import argparse

import pytest

from wanka.config import load_config
from wanka.data import ByteTokenizer, builtin_documents, prepare_documents
from wanka.resilience import preflight as pf
from wanka.resilience.check_cli import add_check_parser


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    docs = builtin_documents()[:120]
    return prepare_documents(docs, tmp_path_factory.mktemp("pf") / "ds", ByteTokenizer(), 0.1)


@pytest.fixture
def overrides(dataset, tmp_path):
    def make(*extra: str) -> list[str]:
        return [f'data.path="{dataset}"', "data.seq_len=96", "model.index_topk=16",
                "train.micro_batch_size=2", "train.steps=10", "train.warmup_steps=2",
                "checkpoint.every=5", f'run.dir="{tmp_path / "run"}"',
                f'resilience.snapshot_dir="{tmp_path / "shm"}"', *extra]  # fmt: skip

    return make


def by_name(results: list[pf.CheckResult]) -> dict[str, pf.CheckResult]:
    return {r.name: r for r in results}


def failing(overrides, *extra: str, world: int = 2, **kw) -> dict[str, pf.CheckResult]:
    results = pf.static_checks(load_config(None, overrides(*extra)), world, **kw)
    return {r.name: r for r in results if not r.ok}


def test_sound_job_passes(overrides):
    report = pf.preflight(load_config(None, overrides()), nproc=2)
    assert report.ok, report.format()
    names = [r.name for r in report.results]
    for name in ("config", "parallel.degrees", "sequence", "batch", "memory", "data",
                 "data.tokenizer", "checkpoint", "snapshot"):  # fmt: skip
        assert name in names
    text = report.format()
    assert "FAIL" not in text and text.splitlines()[-1].endswith("ready to launch")
    batch = by_name(report.results)["batch"].message
    assert "global batch 4 seqs = micro 2 x accum 1 x dp 2; 384 tokens/step" in batch


def test_bad_degrees(overrides):
    bad = failing(overrides, "parallel.dp_shard=4")
    assert "does not match the world size 2" in bad["parallel.degrees"].message
    assert "--nproc" in bad["parallel.degrees"].message
    bad = failing(overrides, "parallel.ep=2", world=3)
    assert "parallel.ep=2 must divide" in bad["parallel.degrees"].message
    bad = failing(overrides, world=3, nnodes=2)
    assert "same --nproc on every node" in bad["parallel.degrees"].message


def test_topk_beyond_seq_len_is_a_warning(overrides):
    from wanka.config import load_config
    from wanka.resilience.preflight import static_checks

    cfg = load_config(None, overrides("model.index_topk=128"))
    [seq] = [r for r in static_checks(cfg, 2, 1) if r.name == "sequence"]
    assert seq.ok and seq.warn  # it trains (dense at this length): said, not refused
    assert "model.index_topk=128 >= data.seq_len=96" in seq.message
    assert "set model.index_topk below 96" in seq.message


def test_memory_over_capacity(overrides):
    bad = failing(overrides, capacity_bytes=1 << 20)
    assert set(bad) == {"memory"}
    assert "lower train.micro_batch_size" in bad["memory"].message
    near = by_name(pf.static_checks(load_config(None, overrides()), 2, capacity_bytes=None))
    assert near["memory"].ok  # the real capacity of this machine holds the tiny job


def test_unwritable_checkpoint_and_snapshot_dirs(overrides, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    bad = failing(overrides, f'run.dir="{blocker}/run"', f'resilience.snapshot_dir="{blocker}/s"')
    assert (
        "is not writable" in bad["checkpoint"].message
        and "set run.dir" in bad["checkpoint"].message
    )
    assert "resilience.snapshot_dir" in bad["snapshot"].message
    ok = by_name(pf.static_checks(load_config(None, overrides("resilience.snapshot_every=0",
                                                               f'run.dir="{blocker}/r"')), 2))  # fmt: skip
    assert ok["snapshot"].ok and "off" in ok["snapshot"].message and not ok["checkpoint"].ok


def test_missing_data_and_vocab_mismatch(overrides, tmp_path):
    bad = failing(overrides, f'data.path="{tmp_path / "nope"}"')
    assert "wanka data prepare" in bad["data"].message
    bad = failing(overrides, "model.vocab_size=128")
    assert "set model.vocab_size=256" in bad["data"].message
    bad = failing(overrides, f'data.tokenizer="{tmp_path / "missing.json"}"')
    assert "tokenizer file not found" in bad["data"].message


def test_config_errors_and_missing_checkpoint_to_load(overrides, tmp_path):
    cfg = load_config(None, overrides())
    cfg.model.n_heads = 3  # built in code, not loaded: the config check re-validates it
    bad = {r.name: r for r in pf.static_checks(cfg, 2) if not r.ok}
    assert "model.n_heads" in bad["config"].message
    bad = failing(overrides, f'checkpoint.load="{tmp_path / "gone"}"')
    assert "checkpoint.load" in bad["checkpoint"].message


def test_link_rounds_cover_every_ring_link_with_disjoint_pairs():
    where = [(n, lr) for n in ("a", "b", "c") for lr in range(3)]  # 3 nodes x 3 ranks
    rounds = pf.link_rounds(where)
    for pairs_per_round in rounds.values():
        for pairs in pairs_per_round:
            ranks = [r for p in pairs for r in p]
            assert len(ranks) == len(set(ranks))  # no rank in two timed pairs at once
    intra = {frozenset(p) for rd in rounds["intra_node"] for p in rd}
    inter = {frozenset(p) for rd in rounds["inter_node"] for p in rd}
    assert all(where[a][0] == where[b][0] for a, b in intra) and len(intra) == 9
    assert all(where[a][0] != where[b][0] and where[a][1] == where[b][1] for a, b in inter)
    assert len(inter) == 9
    assert set(pf.link_rounds([("a", 0), ("a", 1)])) == {"intra_node"}


def record(rank: int, node: str, gflops: float, links=(), free: int = 8 << 30) -> dict:
    return {"rank": rank, "node": node, "init_s": 0.1, "links": list(links), "gflops": gflops,
            "free": free}  # fmt: skip


def link(cls: str, a: int, b: int, gbps: float | None, error: str = "") -> dict:
    return {"cls": cls, "pair": (a, b), "gbps": gbps, "error": error}


def test_collate_flags_slow_and_broken_links_slow_devices_and_low_memory():
    recs = [record(0, "0", 50, [link("intra_node", 0, 1, 10.0), link("inter_node", 0, 2, 1.0)]),
            record(1, "0", 48, [link("inter_node", 1, 3, 0.4)]),
            record(2, "1", 52, [link("intra_node", 2, 3, 9.0)]),
            record(3, "1", 20, free=1 << 30)]  # fmt: skip
    res = by_name(pf.collate(recs, need_bytes=2 << 30))
    assert res["link.intra_node"].ok and not res["link.intra_node"].warn
    # 0.4 GB/s vs a 0.7 median: slower than its peers but within 2x -> a warning only.
    assert res["link.inter_node"].ok and res["link.inter_node"].warn
    assert not res["compute.burn_in"].ok and "rank 3 (node 1)" in res["compute.burn_in"].message
    assert not res["memory.free"].ok and "rank 3" in res["memory.free"].message
    recs[1]["links"] = [link("inter_node", 1, 3, 0.2)]  # now > 2x slower than the median
    assert not by_name(pf.collate(recs))["link.inter_node"].ok
    recs[1]["links"] = [link("inter_node", 1, 3, None, "RuntimeError: timed out after 20.0s")]
    res = by_name(pf.collate(recs))
    assert not res["link.inter_node"].ok and "rank 1 (node 0) <-> rank 3 (node 1)" in res[
        "link.inter_node"].message  # fmt: skip
    assert res["memory.free"].ok  # no estimate given: free memory is only reported


def run_cli(*argv: str) -> int:
    p = argparse.ArgumentParser(prog="wanka")
    add_check_parser(p.add_subparsers(dest="cmd", required=True))
    args = p.parse_args(list(argv))
    return args.fn(args)


def test_cli_exit_codes(overrides, tmp_path, capsys):
    sets = [x for o in overrides() for x in ("--set", o)]
    assert run_cli("check", *sets, "--nproc", "2", "--no-live") == 0
    assert "ready to launch" in capsys.readouterr().out
    assert run_cli("check", *sets, "--set", "train.micro_batch_size=100000", "--nproc", "2") == 2
    out = capsys.readouterr().out
    assert "FAIL  memory" in out and out.count("FAIL  ") == 1
    assert run_cli("check", str(tmp_path / "missing.toml")) == 2
    err = capsys.readouterr().err
    assert err.startswith("wanka check: config error") and err.count("\n") == 1
