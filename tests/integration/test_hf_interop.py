"""Export to Hugging Face `deepseek_v32`, checked against transformers' own implementation
(an independent oracle for the model math), import back, and the CLI around both."""

from __future__ import annotations

import json

import pytest
import torch

from wanka.config.schema import ModelConfig
from wanka.infer.cache import KVCache
from wanka.interop.cli import write_hf
from wanka.interop.hf import from_hf, model_config, read_tensors
from wanka.models.transformer import Transformer

from .helpers import wanka

transformers = pytest.importorskip("transformers")

# 16 index heads: with few heads ReLU zeros make exact ties at the k-th score common, and
# torch.topk (transformers) and wanka (the most recent key wins) break ties differently.
CFG = ModelConfig(attention="mla", vocab_size=256, dim=64, n_layers=3, n_heads=4,
                  q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16, n_index_heads=16, index_head_dim=16, index_topk=12,
                  n_dense_layers=1, dense_hidden=96, n_experts=8, n_active_experts=2,
                  expert_hidden=32, n_shared_experts=1, route_scale=2.5, n_expert_groups=2,
                  n_limited_groups=1, mtp_depth=1, max_seq_len=128, tie_embeddings=False)  # fmt: skip


def _model(cfg: ModelConfig = CFG, seed: int = 0) -> Transformer:
    """Random weights with every norm, LayerNorm bias and expert bias moved off its init
    value, so a mis-mapped one shows."""
    with torch.device("meta"):
        m = Transformer(cfg)
    m.to_empty(device="cpu")
    m.init_weights(seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("wq_b.weight", "wkv_a.weight", "wk.weight")):
                p.mul_(8.0)  # sharper attention and indexer scores
        for moe in m.moe_layers():
            moe.expert_bias.copy_(0.05 * torch.randn(moe.expert_bias.shape, generator=g))
    return m.eval()


def _wanka_logits(m: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    B, L = tokens.shape
    cache = KVCache(len(m.layers), B, tokens.device)
    docs = cache.set_docs(0, torch.zeros(B, L, dtype=torch.long))
    with torch.no_grad():
        return m.decode(tokens, torch.arange(L).expand(B, L), cache, 0, docs)[0]


def _load_hf(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    model = _model()
    write_hf(model.state_dict(), CFG, "byte", out)
    return model, out


@pytest.mark.parametrize("L", [10, 48])  # dense (L <= k = 12) and sparse phases
def test_transformers_loads_the_export_and_matches_logits(exported, L):
    model, out = exported
    hf, info = _load_hf(out)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    # Only the MTP layer (which transformers does not run) is left unused.
    assert all(k.startswith(f"model.layers.{CFG.n_layers}.") for k in info["unexpected_keys"])
    tokens = torch.randint(0, 256, (2, L), generator=torch.Generator().manual_seed(L))
    with torch.no_grad():
        theirs = hf(tokens).logits
    ours = _wanka_logits(model, tokens)
    assert ours.abs().max() > 0.5  # not a degenerate comparison
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()


def test_a_wrong_rope_layout_would_be_caught(exported, tmp_path):
    """Negative control: without the RoPE row permutation the logits differ."""
    from wanka.interop import hf as hfmod

    model, _ = exported
    orig = hfmod._permute_rope_rows
    try:
        hfmod._permute_rope_rows = lambda w, cfg, heads, inverse: w
        write_hf(model.state_dict(), CFG, "byte", tmp_path)
    finally:
        hfmod._permute_rope_rows = orig
    hf, _ = _load_hf(tmp_path)
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (hf(tokens).logits - _wanka_logits(model, tokens)).abs().max()
    assert diff > 1e-3


def test_export_import_round_trip_is_bitwise(exported):
    model, out = exported
    cfg = model_config(json.loads((out / "config.json").read_text()))
    assert cfg.attention == "mla" and cfg.mtp_depth == 1 and not cfg.tie_embeddings
    back = from_hf(read_tensors(out), cfg)
    mine = model.state_dict()
    assert set(back) == set(mine)
    for k, v in mine.items():
        assert torch.equal(back[k], v), k


def test_byte_tokenizer_is_exported(exported):
    _, out = exported
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "héllo\n\tdef x():"
    assert tok.encode(text, add_special_tokens=False) == list(text.encode("utf-8"))


def _train_mla(tmp_path, name: str, *extra: str):
    run = tmp_path / name
    sets = ['model.attention="mla"', "model.index_share_every=1", "model.index_head_dim=16",
            "train.steps=2", "checkpoint.every=2", "data.val_batches=1", "data.seq_len=64",
            "train.micro_batch_size=2", "train.warmup_steps=1", "run.tensorboard=false",
            f'run.dir="{run}"', *extra]  # fmt: skip
    r = wanka("train", "configs/demo.toml", "--nproc", "2", *sum((["--set", s] for s in sets), []))
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def test_cli_export_import_generate(tmp_path):
    """A trained MLA run -> export -> import -> the imported run generates the same text."""
    run = _train_mla(tmp_path, "mla")
    out = tmp_path / "hf"
    r = wanka("export", str(run), "--format", "hf", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    r = wanka("export", str(run), "--out", str(out))
    assert r.returncode == 2 and "--force" in r.stderr  # never overwrites silently
    r = wanka("import", str(out), "--out", str(tmp_path / "back"))
    assert r.returncode == 0, r.stderr[-2000:]
    gen = [wanka("generate", str(d), "--prompt", "def f(", "--max-new-tokens", "12")
           for d in (run, tmp_path / "back")]  # fmt: skip
    assert gen[0].returncode == 0 and gen[0].stdout == gen[1].stdout, gen[1].stderr[-2000:]
    # The imported run trains on: its model-only checkpoint loads, the optimizer starts fresh,
    # and its first loss is the trained model's, not a fresh init's.
    back = tmp_path / "back"
    r = wanka("train", str(back / "config.toml"), "--set", "train.steps=1", "--set",
              "data.seq_len=64", "--set", "train.micro_batch_size=2", "--set", "data.val_batches=1",
              "--set", "run.tensorboard=false")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    first = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][0]
    tuned = [json.loads(x) for x in (back / "metrics.jsonl").read_text().splitlines()][0]
    assert first["step"] == tuned["step"] == 1
    assert tuned["lm_loss"] < first["lm_loss"] - 0.1, (tuned, first)


def test_cli_refuses_what_the_format_cannot_hold(tmp_path):
    bad = tmp_path / "mqa"
    bad.mkdir()
    (bad / "config.toml").write_text('[model]\nflavor = "tiny"\n')
    r = wanka("export", str(bad), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "model.attention = 'mla'" in r.stderr
    (bad / "config.toml").write_text('[model]\nattention = "mla"\nindex_share_every = 2\n')
    r = wanka("export", str(bad), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "index_share_every" in r.stderr
    hf = tmp_path / "hfbad"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    r = wanka("import", str(hf), "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "deepseek_v32" in r.stderr and "Traceback" not in r.stderr


def test_import_of_mismatched_weights_is_one_line(exported, tmp_path):
    _, out = exported
    cfg = json.loads((out / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32}))
    r = wanka("import", str(bad), "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "does not match its config.json" in r.stderr, r.stderr[-2000:]


def _set_dense_warmup(run) -> None:
    """The run's config says its checkpoint is from the dense warm-up (as a step-0 or
    phase = "dense_warmup" checkpoint is): load_trained decodes it densely."""
    import dataclasses

    from wanka.config.loader import dump_toml, load_config

    cfg = load_config(run / "config.toml")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, phase="dense_warmup"))
    (run / "config.toml").write_text(dump_toml(cfg))


def test_dense_warmup_export_computes_what_wanka_decodes(exported, tmp_path):
    """A dense-warm-up checkpoint is decoded densely (its indexer is untrained): its export
    used to say the training index_topk, so transformers and the re-imported run attended
    sparsely through an untrained indexer above it."""
    from wanka.cli import main
    from wanka.infer.load import load_trained

    model, out = exported
    run, hf2, back = tmp_path / "run", tmp_path / "hf2", tmp_path / "back"
    assert main(["import", str(out), "--out", str(run)]) == 0
    _set_dense_warmup(run)
    assert main(["export", str(run), "--out", str(hf2)]) == 0
    assert json.loads((hf2 / "config.json").read_text())["index_topk"] == CFG.max_seq_len
    assert main(["import", str(hf2), "--out", str(back)]) == 0
    L = 48  # > the training index_topk 12: sparse there
    tokens = torch.randint(0, 256, (2, L), generator=torch.Generator().manual_seed(5))
    dense = _wanka_logits(load_trained(run)[0], tokens)
    assert torch.equal(_wanka_logits(load_trained(back)[0], tokens), dense)
    with torch.no_grad():
        theirs = _load_hf(hf2)[0](tokens).logits
    assert torch.allclose(theirs, dense, atol=1e-4, rtol=0), (theirs - dense).abs().max()
    # Negative control: at this length the sparse model computes something else.
    assert (_wanka_logits(model, tokens) - dense).abs().max() > 1e-3


def test_transformers_save_pretrained_round_trip(exported, tmp_path, capsys):
    """save_pretrained of an export drops the MTP layer but keeps num_nextn_predict_layers:
    the import goes on without MTP, says so in one line, and computes the same logits."""
    from wanka.cli import main
    from wanka.infer.load import load_trained

    model, out = exported
    hf, _ = _load_hf(out)
    hf.save_pretrained(str(tmp_path / "saved"))
    capsys.readouterr()
    assert main(["import", str(tmp_path / "saved"), "--out", str(tmp_path / "run")]) == 0
    assert "importing without MTP" in capsys.readouterr().err
    back, cfg, _ = load_trained(tmp_path / "run")
    assert cfg.model.mtp_depth == 0 and cfg.model.route_scale == CFG.route_scale
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(7))
    assert torch.equal(_wanka_logits(back, tokens), _wanka_logits(model, tokens))
