"""Tests of the data layer: corpus, tokenizers, prepared shards and the packing loader."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from wanka.data import (
    Batch,
    ByteTokenizer,
    Document,
    PackedLoader,
    TokenDataset,
    builtin_documents,
    ensure_builtin_dataset,
    load_tokenizer,
    main_prepare,
    prepare_documents,
    read_input_files,
    split_documents,
    validation_batches,
)
from wanka.data.corpus import pydoc_documents
from wanka.data.prepare import read_meta

SEQ = 16


def synthetic_docs(n: int = 24, seed: int = 0) -> list[Document]:
    # Very uneven lengths (1..~60 bytes, plus a long one) to exercise packing edge cases.
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        length = 200 if i == 3 else int(rng.integers(1, 60))
        text = "".join(chr(ord("a") + int(c)) for c in rng.integers(0, 26, length))
        docs.append(Document(f"doc{i}", text))
    return docs


@pytest.fixture
def dataset_dir(tmp_path: Path) -> Path:
    return prepare_documents(synthetic_docs(), tmp_path / "ds", ByteTokenizer(), val_fraction=0.2)


def reference_window(ds: TokenDataset, seed: int, epoch: int, w: int, seq_len: int):
    """Naive definition: materialise the whole epoch stream and slice it."""
    order = np.random.default_rng([seed, epoch]).permutation(ds.num_docs)
    toks = np.concatenate([np.asarray(ds.doc_tokens(i), dtype=np.int64) for i in order])
    docs = np.concatenate([np.full(ds.doc_bounds(i)[1] - ds.doc_bounds(i)[0], i) for i in order])
    s = w * seq_len
    t, d = toks[s : s + seq_len + 1], docs[s : s + seq_len + 1]
    labels = np.where(d[1:] == d[:-1], t[1:], -100)
    positions, doc_ids = np.zeros(seq_len, np.int64), np.zeros(seq_len, np.int64)
    for j in range(1, seq_len):
        same = d[j] == d[j - 1]
        positions[j] = positions[j - 1] + 1 if same else 0
        doc_ids[j] = doc_ids[j - 1] + (0 if same else 1)
    return t[:-1], labels, positions, doc_ids


def assert_batches_equal(a: Batch, b: Batch) -> None:
    for name in ("tokens", "labels", "positions", "doc_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def cat(batches: list[Batch]) -> Batch:
    return Batch(*(torch.cat([getattr(b, n) for b in batches]) for n in Batch.__dataclass_fields__))


# ---------------------------------------------------------------- corpus


def test_builtin_corpus_nonempty_mixed_and_deterministic() -> None:
    docs = builtin_documents()
    names = [d.name for d in docs]
    assert len(docs) > 500
    assert any(n.startswith("stdlib:") for n in names)
    assert any(n.startswith("pydoc:") for n in names)
    assert "stdlib:json/__init__.py" in names
    assert not any("site-packages" in n for n in names)
    assert all(d.text.strip() for d in docs)
    assert len(set(names)) == len(names)
    stdlib = [n for n in names if n.startswith("stdlib:")]
    assert stdlib == sorted(stdlib)
    assert [d.name for d in pydoc_documents()] == [n for n in names if n.startswith("pydoc:")]


def test_split_is_disjoint_deterministic_and_seeded() -> None:
    docs = [Document(f"d{i}", "x") for i in range(500)]
    train, val = split_documents(docs, 0.1, seed=1)
    assert split_documents(docs, 0.1, seed=1) == (train, val)
    assert {d.name for d in train}.isdisjoint(d.name for d in val)
    assert len(train) + len(val) == len(docs)
    assert 20 < len(val) < 80
    assert split_documents(docs, 0.1, seed=2)[1] != val
    # Tiny inputs still get one doc in each split; no val when asked for none.
    t, v = split_documents(docs[:2], 0.01, seed=0)
    assert len(t) == 1 and len(v) == 1
    assert split_documents(docs[:5], 0.0, seed=0) == (docs[:5], [])


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip() -> None:
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256
    text = "héllo wörld — 日本語 🐍"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and max(ids) > 127
    assert tok.decode(ids) == text
    assert tok.decode(ids[:2]) == "h\ufffd"  # a cut multi-byte character decodes, replaced


def test_missing_tokenizer_file_is_a_clear_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer file not found: .*nope.json"):
        load_tokenizer(str(tmp_path / "nope.json"))


def test_hf_tokenizer_prepare_and_load(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["the cat sat on the mat", "a dog ate the bone", "the end"]
    hf.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    hf.save(str(path))

    tok = load_tokenizer(str(path.parent))  # a folder with tokenizer.json also works
    assert tok.name.startswith("hf-") and tok.name == load_tokenizer(str(path)).name
    assert tok.vocab_size == hf.get_vocab_size()
    ids = tok.encode("the cat ate the bone")
    assert list(ids) == hf.encode("the cat ate the bone").ids
    assert tok.decode(ids) == "the cat ate the bone"

    docs = [Document(f"d{i}", text) for i, text in enumerate(corpus * 4)]
    out = prepare_documents(docs, tmp_path / "ds", tok, val_fraction=0.25)
    meta = read_meta(out)
    assert meta["tokenizer"]["name"] == tok.name and meta["dtype"] == "uint8"
    train, val = split_documents(docs, 0.25, seed=0)
    ds = TokenDataset(out, "train")
    assert ds.vocab_size == tok.vocab_size and ds.num_docs == len(train)
    assert [int(x) for x in ds.doc_tokens(0)] == list(tok.encode(train[0].text))
    # The same dir may not be reused with another tokenizer.
    with pytest.raises(ValueError, match="prepared with tokenizer"):
        prepare_documents(docs, out, ByteTokenizer())


# ---------------------------------------------------------------- prepare


def test_prepare_from_txt_and_jsonl(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first document\nwith two lines\n")
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"text": "ünïcode line"}) + "\n\n" + json.dumps({"text": "third"}) + "\n"
    )
    docs = read_input_files([tmp_path / "a.txt", tmp_path / "b.jsonl"])
    assert [d.text for d in docs] == ["first document\nwith two lines\n", "ünïcode line", "third"]
    assert docs[2].name.endswith("b.jsonl:3")
    assert read_input_files([tmp_path]) == docs  # a folder expands to its files, sorted

    out = tmp_path / "ds"
    rc = main_prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], str(out), None, 0.3, 0)
    assert rc == 0
    train, val = split_documents(docs, 0.3, seed=0)
    tok = ByteTokenizer()
    for split, expected in (("train", train), ("val", val)):
        ds = TokenDataset(out, split)
        assert ds.num_docs == len(expected)
        assert ds.num_tokens == sum(len(tok.encode(d.text)) for d in expected)
        assert ds.tokens.dtype == np.uint8 and ds.offsets.dtype == np.int64
        assert [tok.decode(ds.doc_tokens(i)) for i in range(ds.num_docs)] == [
            d.text for d in expected
        ]
        start, end = ds.doc_bounds(ds.num_docs - 1)
        assert end == ds.num_tokens and start < end


def test_bad_jsonl_line_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        read_input_files([bad])
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        read_input_files([bad])
    assert main_prepare([str(bad)], str(tmp_path / "ds"), None, 0.1, 0) == 2
    assert not (tmp_path / "ds").exists()


class SlowByteTokenizer(ByteTokenizer):
    def encode(self, text: str) -> np.ndarray:
        time.sleep(0.002)  # makes concurrent preparers overlap
        return super().encode(text)


def test_prepare_is_idempotent_and_atomic_under_races(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs, out = synthetic_docs(), tmp_path / "ds"
    lost, real_rename = [], os.rename

    def rename(src, dst) -> None:
        try:
            real_rename(src, dst)
        except OSError:
            lost.append(src)
            raise

    monkeypatch.setattr(os, "rename", rename)
    with ThreadPoolExecutor(4) as pool:
        paths = list(
            pool.map(lambda _: prepare_documents(docs, out, SlowByteTokenizer(), 0.2), range(4))
        )
    assert all(p == out for p in paths)
    assert lost  # some preparers lost the race and fell back to the winner's dataset
    assert TokenDataset(out, "train").num_docs + TokenDataset(out, "val").num_docs == len(docs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no temp dirs left behind
    mtime = os.stat(out / "train.bin").st_mtime_ns
    prepare_documents(docs, out, ByteTokenizer(), 0.2)
    assert os.stat(out / "train.bin").st_mtime_ns == mtime  # complete dataset kept as is
    # A non-empty dir that is not a dataset is never clobbered.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not a complete prepared dataset"):
        prepare_documents(docs, tmp_path / "other", ByteTokenizer())


def test_missing_or_corrupt_dataset_is_a_clear_value_error(
    tmp_path: Path, dataset_dir: Path
) -> None:
    with pytest.raises(ValueError, match="no prepared dataset at .*wanka data prepare"):
        TokenDataset(tmp_path / "missing", "train")
    with open(dataset_dir / "train.bin", "ab") as f:
        f.write(b"junk")
    with pytest.raises(ValueError, match="corrupt dataset .*train.bin.*wanka data prepare"):
        TokenDataset(dataset_dir, "train")


def test_builtin_dataset(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    path = ensure_builtin_dataset(tmp_path)
    assert time.perf_counter() - t0 < 20
    t0 = time.perf_counter()
    assert ensure_builtin_dataset(tmp_path) == path  # fast path
    assert time.perf_counter() - t0 < 0.5
    train, val = TokenDataset(path, "train"), TokenDataset(path, "val")
    assert train.num_tokens > 1_000_000 and val.num_tokens > 1000
    assert train.vocab_size == 256
    text = ByteTokenizer().decode(np.concatenate([train.doc_tokens(i) for i in range(20)]))
    assert "def " in text or "import " in text
    batch = PackedLoader(train, 128, 4, 0, 1, seed=0).next_batch()
    assert batch.tokens.shape == (4, 128) and batch.tokens.max() < 256


# ---------------------------------------------------------------- loader


def test_windows_match_naive_reference_across_epochs(dataset_dir: Path) -> None:
    ds = TokenDataset(dataset_dir, "train")
    loader = PackedLoader(ds, SEQ, 3, 0, 1, seed=7)
    n = loader.windows_per_epoch
    assert n == (ds.num_tokens - 1) // SEQ
    g = 0
    for _ in range(2 * n // 3 + 2):  # well into the third epoch
        batch = loader.next_batch()
        assert batch.tokens.dtype == torch.int64 and batch.labels.dtype == torch.int64
        assert batch.positions.dtype == torch.int64 and batch.doc_ids.dtype == torch.int32
        for row in range(3):
            epoch, w = divmod(g, n)
            expected = reference_window(ds, 7, epoch, w, SEQ)
            got = (batch.tokens[row], batch.labels[row], batch.positions[row], batch.doc_ids[row])
            for e, a in zip(expected, got):
                np.testing.assert_array_equal(a.numpy(), e)
            g += 1
    assert loader.epoch == g // n and loader.window == g % n


def test_labels_positions_doc_ids_at_boundaries(dataset_dir: Path) -> None:
    ds = TokenDataset(dataset_dir, "train")
    batch = PackedLoader(ds, SEQ, 32, 0, 1, seed=0).next_batch()
    toks, labels, pos, ids = batch.tokens, batch.labels, batch.positions, batch.doc_ids
    boundary = labels == -100
    assert boundary.any() and (~boundary).any()
    # Within a row, a new fragment starts exactly after each -100 label.
    assert torch.equal(boundary[:, :-1], ids[:, 1:] != ids[:, :-1])
    assert torch.equal(labels[:, :-1][~boundary[:, :-1]], toks[:, 1:][~boundary[:, :-1]])
    assert (pos[:, 0] == 0).all() and (ids[:, 0] == 0).all()
    new_doc = ids[:, 1:] != ids[:, :-1]
    assert (pos[:, 1:][new_doc] == 0).all()
    assert torch.equal(pos[:, 1:][~new_doc], pos[:, :-1][~new_doc] + 1)
    assert ((ids[:, 1:] - ids[:, :-1]) >= 0).all() and ((ids[:, 1:] - ids[:, :-1]) <= 1).all()


def test_dp_shards_concatenate_to_single_process_batch(dataset_dir: Path) -> None:
    ds = TokenDataset(dataset_dir, "train")
    single = PackedLoader(ds, SEQ, 4, 0, 1, seed=3)
    ranks = [PackedLoader(ds, SEQ, 2, r, 2, seed=3) for r in range(2)]
    for _ in range(single.windows_per_epoch // 2):  # crosses an epoch boundary
        assert_batches_equal(single.next_batch(), cat([r.next_batch() for r in ranks]))
    assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()
    assert single.epoch >= 1


def test_resume_equals_uninterrupted(dataset_dir: Path) -> None:
    ds = TokenDataset(dataset_dir, "train")
    reference = PackedLoader(ds, SEQ, 3, 0, 1, seed=5)
    expected = [reference.next_batch() for _ in range(12)]
    first = PackedLoader(ds, SEQ, 3, 0, 1, seed=5)
    for _ in range(5):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    assert all(isinstance(v, int) for v in state.values())
    resumed = PackedLoader(ds, SEQ, 3, 0, 1, seed=5)
    resumed.load_state_dict(state)
    for exp in expected[5:]:
        assert_batches_equal(resumed.next_batch(), exp)
    with pytest.raises(ValueError, match="seed"):
        PackedLoader(ds, SEQ, 3, 0, 1, seed=6).load_state_dict(state)
    # The dataset prepared again (an edited file: the same window count, other text there).
    edited = {**state, "data_tokens": state["data_tokens"] + 20}
    with pytest.raises(ValueError, match="changed since the checkpoint"):
        PackedLoader(ds, SEQ, 3, 0, 1, seed=5).load_state_dict(edited)
    older = {k: v for k, v in state.items() if not k.startswith("data_")}
    PackedLoader(ds, SEQ, 3, 0, 1, seed=5).load_state_dict(older)  # not recorded: not checked


def test_resume_dp2_checkpoint_with_dp1(dataset_dir: Path) -> None:
    ds = TokenDataset(dataset_dir, "train")
    reference = PackedLoader(ds, SEQ, 4, 0, 1, seed=1)
    expected = [reference.next_batch() for _ in range(10)]
    ranks = [PackedLoader(ds, SEQ, 2, r, 2, seed=1) for r in range(2)]
    for _ in range(4):
        for r in ranks:
            r.next_batch()
    resumed = PackedLoader(ds, SEQ, 4, 0, 1, seed=1)
    resumed.load_state_dict(ranks[1].state_dict())
    for exp in expected[4:]:
        assert_batches_equal(resumed.next_batch(), exp)


def test_epoch_rollover_reshuffles(dataset_dir: Path) -> None:
    ds = TokenDataset(dataset_dir, "train")
    loader = PackedLoader(ds, SEQ, 1, 0, 1, seed=0)
    n = loader.windows_per_epoch
    epoch0 = [loader.next_batch().tokens for _ in range(n)]
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["window"] == 0
    epoch1 = [loader.next_batch().tokens for _ in range(n)]
    assert loader.epoch == 2 and loader.window == 0
    assert not all(torch.equal(a, b) for a, b in zip(epoch0, epoch1))
    # Each epoch covers the same tokens, just in another document order.
    tail = ds.num_tokens - n * SEQ  # tokens never used as inputs in the dropped tail
    assert 0 < tail <= SEQ
    counts0 = torch.bincount(torch.cat(epoch0).flatten(), minlength=256)
    counts1 = torch.bincount(torch.cat(epoch1).flatten(), minlength=256)
    assert (counts0 - counts1).abs().sum() <= 2 * tail


def test_loader_rejects_dataset_too_small(tmp_path: Path) -> None:
    out = prepare_documents(
        [Document("a", "abc"), Document("b", "d")],
        tmp_path / "ds",
        ByteTokenizer(),
        val_fraction=0.0,
    )
    with pytest.raises(ValueError, match="too few"):
        PackedLoader(TokenDataset(out, "train"), SEQ, 1, 0, 1, seed=0)
    with pytest.raises(ValueError, match="val split of .* is empty"):  # val_fraction 0
        validation_batches(TokenDataset(out, "val"), SEQ, 1, 1, 0, 1)
    out = prepare_documents([Document("a", "abc" * 40), Document("b", "d")], tmp_path / "ds2",
                            ByteTokenizer(), val_fraction=0.5, min_val_chars=0)  # fmt: skip
    with pytest.raises(ValueError, match="fewer than one window"):  # "d": 1 token
        validation_batches(TokenDataset(out, "val"), SEQ, 1, 1, 0, 1)


def test_validation_batches_fixed_and_sharded(dataset_dir: Path) -> None:
    val = TokenDataset(dataset_dir, "val")
    n_windows = (val.num_tokens - 1) // 4
    assert n_windows >= 8
    full = validation_batches(val, 4, 2, 100, 0, 1)
    assert len(full) == n_windows // 2
    assert all(
        torch.equal(a.tokens, b.tokens)
        for a, b in zip(full, validation_batches(val, 4, 2, 100, 0, 1))
    )
    shards = [validation_batches(val, 4, 1, 100, r, 2) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == len(full)
    for f, a, b in zip(full, *shards):
        assert_batches_equal(f, cat([a, b]))
    # No shuffle: the first window is the start of the first val document.
    first = np.asarray(val.tokens[:4], dtype=np.int64)
    np.testing.assert_array_equal(full[0].tokens[0].numpy(), first)


def test_loader_tolerates_empty_documents_in_index(dataset_dir: Path) -> None:
    # prepare drops empty documents, but other writers may not: duplicate an offset.
    ds = TokenDataset(dataset_dir, "train")
    offsets = np.insert(ds.offsets, [1, 1, 5], [ds.offsets[1], ds.offsets[1], ds.offsets[5]])
    offsets.tofile(dataset_dir / "train.idx")
    meta = json.loads((dataset_dir / "meta.json").read_text())
    meta["splits"]["train"]["num_docs"] = len(offsets) - 1
    (dataset_dir / "meta.json").write_text(json.dumps(meta))
    ds = TokenDataset(dataset_dir, "train")
    assert ds.doc_bounds(1) == ds.doc_bounds(2) == (ds.offsets[1], ds.offsets[1])
    loader = PackedLoader(ds, SEQ, 2, 0, 1, seed=4)
    for g in range(0, 2 * loader.windows_per_epoch, 2):
        batch = loader.next_batch()
        for row in range(2):
            epoch, w = divmod(g + row, loader.windows_per_epoch)
            expected = reference_window(ds, 4, epoch, w, SEQ)
            got = (batch.tokens[row], batch.labels[row], batch.positions[row], batch.doc_ids[row])
            for e, a in zip(expected, got):
                np.testing.assert_array_equal(a.numpy(), e)


def test_a_tokenizer_whose_ids_have_gaps_counts_up_to_its_largest_id(tmp_path: Path) -> None:
    """vocab_size was the number of tokens: ids above it (an added special token at the end of
    a reserved range) were masked from generation and overflowed a model sized to the count."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    hf = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "eos": 9}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.vocab_size == 10 and list(tok.encode("a eos")) == [1, 9]
