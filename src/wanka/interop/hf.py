"""Hugging Face `deepseek_v32` checkpoints: export a wanka MLA model, import one back.

The layout is DeepSeek-V3.2's as transformers reads it (config.json + safetensors; checked
against `transformers`' DeepseekV32ForCausalLM in tests/integration/test_hf_interop.py):
wanka's MLA parameters map one to one onto it, except that its attention RoPE is interleaved
(pairs 2i, 2i+1) where wanka's is half-split (pairs i, i + d/2): the RoPE rows of the query
and key projections are permuted on the way out and back. The indexer's RoPE is half-split on
both sides. Experts are written per expert (`mlp.experts.E.{gate,up,down}_proj`), as
DeepSeek's own checkpoints are. MTP depth d is layer num_hidden_layers + d - 1 with DeepSeek's
names (enorm, hnorm, eh_proj over [embedding, hidden], shared_head); transformers does not
run MTP and skips those keys, vLLM/SGLang-style readers use them.

What the format cannot say is refused in one line: MQA attention, cross-layer index sharing
(deepseek_v32 has an indexer in every layer), expert groups of one expert.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from wanka.config.schema import ModelConfig

MODEL_TYPE = "deepseek_v32"


def check_exportable(cfg: ModelConfig) -> None:
    if cfg.attention != "mla":
        raise ValueError("deepseek_v32 is MLA: this run has model.attention = 'mqa', which the "
                         "format cannot hold; train with model.attention = 'mla'")  # fmt: skip
    if cfg.index_share_every != 1:
        raise ValueError(f"deepseek_v32 runs an indexer in every layer: this run shares indices "
                         f"(model.index_share_every = {cfg.index_share_every}), which the format "
                         "cannot express")  # fmt: skip
    if cfg.n_experts // cfg.n_expert_groups < 2:
        raise ValueError("deepseek_v32 scores expert groups by their top-2 experts: groups of one "
                         f"expert (n_experts {cfg.n_experts} / n_expert_groups "
                         f"{cfg.n_expert_groups}) cannot be expressed")  # fmt: skip
    if cfg.qk_rope_head_dim > cfg.index_head_dim:
        raise ValueError("index_head_dim must be >= qk_rope_head_dim for deepseek_v32")


def hf_config(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.dense_hidden,
        "moe_intermediate_size": cfg.expert_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "index_n_heads": cfg.n_index_heads,
        "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk,
        "n_routed_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.n_active_experts,
        "n_shared_experts": cfg.n_shared_experts,
        "n_group": cfg.n_expert_groups,
        "topk_group": cfg.n_limited_groups,
        "routed_scaling_factor": cfg.route_scale,
        "norm_topk_prob": True,
        "first_k_dense_replace": cfg.n_dense_layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "num_nextn_predict_layers": cfg.mtp_depth,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
    }


# config.json key -> wanka ModelConfig field, for the keys model_config reads (named in errors)
_HF_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads", "max_position_embeddings": "max_seq_len",
    "rms_norm_eps": "norm_eps", "rope_theta": "rope_theta", "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
    "index_n_heads": "n_index_heads", "index_head_dim": "index_head_dim",
    "index_topk": "index_topk", "first_k_dense_replace": "n_dense_layers",
    "intermediate_size": "dense_hidden", "n_routed_experts": "n_experts",
    "num_experts_per_tok": "n_active_experts", "moe_intermediate_size": "expert_hidden",
    "n_shared_experts": "n_shared_experts", "routed_scaling_factor": "route_scale",
    "n_group": "n_expert_groups", "topk_group": "n_limited_groups",
    "num_nextn_predict_layers": "mtp_depth", "tie_word_embeddings": "tie_embeddings",
}  # fmt: skip
# transformers' DeepseekV32Config defaults (5.24): what a key config.json leaves out means
# (save_pretrained may write only what differs from them). A default that does not fit the
# model is refused, naming the key to give; one wanka cannot build is refused by the type and
# range checks below.
_DEFAULTS = {"vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61,
             "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
             "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
             "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048,
             "intermediate_size": 18432, "n_routed_experts": 256, "num_experts_per_tok": 8,
             "moe_intermediate_size": 2048, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
             "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
             "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": False,
             "num_nextn_predict_layers": 0}  # not a transformers key: it runs no MTP  # fmt: skip


def defaulted_keys(hf: dict) -> list[str]:
    """The model keys config.json leaves out (transformers' defaults stand in for them)."""
    return [k for k in _DEFAULTS if k not in hf]


def _check_supported(hf: dict) -> None:
    """Refuse what wanka's model does not compute, so an import never builds another model."""
    rope = hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"config.json's rope_parameters is {rope!r}, not an object")
    if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise ValueError("this checkpoint uses scaled RoPE (yarn), which wanka does not have: "
                         "import a checkpoint with rope_type 'default'")  # fmt: skip
    if hf.get("attention_bias"):
        raise ValueError("this checkpoint has attention biases, which wanka's MLA does not")
    if not hf.get("norm_topk_prob", True):
        raise ValueError("wanka always normalises the selected experts' weights "
                         "(norm_topk_prob = true); this checkpoint does not")  # fmt: skip
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json's hidden_act is {hf['hidden_act']!r}: wanka's FFNs and "
                         "experts are SwiGLU (silu) only; import a checkpoint with "
                         "hidden_act 'silu'")  # fmt: skip


def _dense_layers(hf: dict, values: dict):
    """first_k_dense_replace as transformers builds the layers: its mlp_layer_types when given
    (wanka's dense layers come first, then MoE), else min(first_k_dense_replace, layers)."""
    kinds, n = hf.get("mlp_layer_types"), values["num_hidden_layers"]
    if kinds is None:
        k = values["first_k_dense_replace"]
        ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (k, n))
        return min(k, n) if ints else k
    dense = kinds.count("dense") if isinstance(kinds, list) else -1
    if dense < 0 or kinds != ["dense"] * dense + ["sparse"] * (len(kinds) - dense):
        raise ValueError(f"config.json's mlp_layer_types {kinds!r} is not some 'dense' layers "
                         "followed by 'sparse' ones, the only layout wanka builds")  # fmt: skip
    if len(kinds) != n:
        raise ValueError(f"config.json's mlp_layer_types names {len(kinds)} layers, its "
                         f"num_hidden_layers is {n}: make them agree")  # fmt: skip
    return dense


def model_config(hf: dict, flavor: str = "tiny") -> ModelConfig:
    """The wanka ModelConfig of a deepseek_v32 config.json (every field explicit: `flavor`
    only names the preset a config.toml starts from). Values are type- and range-checked as a
    config.toml's [model] is; a bad one is named by its config.json key."""
    if not isinstance(hf, dict):
        raise ValueError(f"config.json holds a JSON {type(hf).__name__}, not an object: pass a "
                         "Hugging Face checkpoint's config.json")  # fmt: skip
    if hf.get("model_type") != MODEL_TYPE:
        raise ValueError(f"config.json has model_type {hf.get('model_type')!r}: wanka imports "
                         f"{MODEL_TYPE!r} checkpoints")  # fmt: skip
    _check_supported(hf)
    values = {**_DEFAULTS, **{k: hf[k] for k in _HF_FIELDS if k in hf}}
    values["rope_theta"] = (hf.get("rope_parameters") or {}).get(
        "rope_theta", hf.get("rope_theta", 1e4)
    )
    if values["tie_word_embeddings"] is None:
        values["tie_word_embeddings"] = False
    values["first_k_dense_replace"] = _dense_layers(hf, values)
    raw = {_HF_FIELDS[k]: v for k, v in values.items()}
    raw["head_dim"] = _sum_or_none(values["qk_nope_head_dim"], values["qk_rope_head_dim"])
    raw.update(flavor=flavor, attention="mla", index_share_every=1)
    from wanka.config.loader import ConfigError, _build, validate
    from wanka.config.schema import DataConfig, JobConfig

    back = {v: k for k, v in _HF_FIELDS.items()}
    back["head_dim"] = "qk_nope_head_dim + qk_rope_head_dim"
    try:
        checked = _build(ModelConfig, raw, "model")  # types, as a config.toml's are checked
        # The preset's other fields stay ModelConfig's defaults, as before type checking.
        cfg = dataclasses.replace(ModelConfig(), **{k: getattr(checked, k) for k in raw})
        # The run directory `wanka import` writes must load: rows no longer than the model's.
        validate(JobConfig(model=cfg, data=DataConfig(seq_len=import_seq_len(cfg))))
    except ConfigError as e:
        key = back.get(e.path.removeprefix("model."), e.path)
        if key in _DEFAULTS and key not in hf:
            raise ValueError(f"config.json lacks {key}, and transformers' default for it "
                             f"({_DEFAULTS[key]!r}) does not fit this model ({e}): give {key} "
                             "in config.json") from None  # fmt: skip
        raise ValueError(
            f"config.json's {key} does not describe a model wanka can build ({e})"
        ) from None
    return cfg


def _sum_or_none(a, b):
    ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (a, b))
    return a + b if ok else None


def import_seq_len(cfg: ModelConfig) -> int:
    """data.seq_len of an imported run: the default 256, or less for a shorter model."""
    from wanka.config.schema import DataConfig

    return min(DataConfig().seq_len, cfg.max_seq_len)


def _rope_perm(r: int) -> torch.Tensor:
    """HF row 2i <- wanka row i, HF row 2i + 1 <- wanka row i + r/2 (interleaved vs half-split)."""
    h = torch.arange(r // 2)
    return torch.stack([h, h + r // 2], 1).reshape(-1)


def _permute_rope_rows(w: torch.Tensor, cfg: ModelConfig, heads: int, inverse: bool):
    """Rows of w grouped per head as [nope | rope] (heads > 0) or [latent | rope] (heads = 0)."""
    r = cfg.qk_rope_head_dim
    perm = _rope_perm(r)
    if inverse:
        perm = torch.argsort(perm)
    if heads:
        w = w.reshape(heads, -1, w.shape[-1])
        return torch.cat([w[:, :-r], w[:, -r:][:, perm]], 1).reshape(-1, w.shape[-1])
    return torch.cat([w[:-r], w[-r:][perm]], 0)


# wanka name (inside a block) -> HF name (inside a decoder layer); tensors copied as they are.
_BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",  # RoPE rows permuted
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",  # RoPE rows permuted
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.indexer.wq_b.weight": "self_attn.indexer.wq_b.weight",
    "attention.indexer.wk.weight": "self_attn.indexer.wk.weight",
    "attention.indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "attention.indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "attention.indexer.weights_proj.weight": "self_attn.indexer.weights_proj.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",
    "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
    "moe.router.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # [E, in, out] -> [out, in]
_MTP_NAMES = {"embed_norm.weight": "enorm.weight", "hidden_norm.weight": "hnorm.weight",
              "norm.weight": "shared_head.norm.weight"}  # fmt: skip


def _block_to_hf(sd: dict, wanka_prefix: str, hf_prefix: str, cfg: ModelConfig, out: dict):
    for name, t in sd.items():
        if not name.startswith(wanka_prefix):
            continue
        rest = name[len(wanka_prefix) :]
        if rest.startswith("moe.experts."):
            w = rest.rsplit(".", 1)[-1]
            for e in range(t.shape[0]):
                out[f"{hf_prefix}mlp.experts.{e}.{_EXPERTS[w]}.weight"] = t[e].t()
            continue
        if rest not in _BLOCK_NAMES:
            continue
        if rest == "attention.wq_b.weight":
            t = _permute_rope_rows(t, cfg, cfg.n_heads, inverse=False)
        elif rest == "attention.wkv_a.weight":
            t = _permute_rope_rows(t, cfg, 0, inverse=False)
        out[hf_prefix + _BLOCK_NAMES[rest]] = t


def to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """wanka state dict (unsharded) -> deepseek_v32 tensors."""
    check_exportable(cfg)
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": sd["tok_embeddings.weight"],
                                    "model.norm.weight": sd["norm.weight"]}  # fmt: skip
    head = sd["tok_embeddings.weight"] if cfg.tie_embeddings else sd["output.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = head
    for i in range(cfg.n_layers):
        _block_to_hf(sd, f"layers.{i}.", f"model.layers.{i}.", cfg, out)
    for d in range(cfg.mtp_depth):
        p, q = f"mtp.{d}.", f"model.layers.{cfg.n_layers + d}."
        _block_to_hf(sd, p + "block.", q, cfg, out)
        for a, b in _MTP_NAMES.items():
            out[q + b] = sd[p + a]
        proj = sd[
            p + "proj.weight"
        ]  # wanka reads [hidden, embedding]; DeepSeek [embedding, hidden]
        out[q + "eh_proj.weight"] = torch.cat([proj[:, cfg.dim :], proj[:, : cfg.dim]], 1)
        out[q + "embed_tokens.weight"] = sd["tok_embeddings.weight"]
        out[q + "shared_head.head.weight"] = head
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """deepseek_v32 tensors -> wanka state dict (the inverse of to_hf)."""
    inv_block = {v: k for k, v in _BLOCK_NAMES.items()}
    out: dict[str, torch.Tensor] = {"tok_embeddings.weight": tensors["model.embed_tokens.weight"],
                                    "norm.weight": tensors["model.norm.weight"]}  # fmt: skip
    if not cfg.tie_embeddings:
        out["output.weight"] = tensors["lm_head.weight"]
    layers = [(f"model.layers.{i}.", f"layers.{i}.") for i in range(cfg.n_layers)]
    layers += [
        (f"model.layers.{cfg.n_layers + d}.", f"mtp.{d}.block.") for d in range(cfg.mtp_depth)
    ]
    for hf_p, w_p in layers:
        experts: dict[str, dict[int, torch.Tensor]] = {}
        for name, t in tensors.items():
            if not name.startswith(hf_p):
                continue
            rest = name[len(hf_p) :]
            if rest.startswith("mlp.experts."):
                _, _, e, proj, _ = rest.split(".")
                experts.setdefault(proj, {})[int(e)] = t.t()
            elif rest in inv_block:
                if rest == "self_attn.q_b_proj.weight":
                    t = _permute_rope_rows(t, cfg, cfg.n_heads, inverse=True)
                elif rest == "self_attn.kv_a_proj_with_mqa.weight":
                    t = _permute_rope_rows(t, cfg, 0, inverse=True)
                out[w_p + inv_block[rest]] = t
        for w, proj in _EXPERTS.items():
            if proj in experts:
                out[f"{w_p}moe.experts.{w}"] = torch.stack([experts[proj][e]
                                                            for e in range(cfg.n_experts)])  # fmt: skip
    for d in range(cfg.mtp_depth):
        q, p = f"model.layers.{cfg.n_layers + d}.", f"mtp.{d}."
        for a, b in _MTP_NAMES.items():
            out[p + a] = tensors[q + b]
        eh = tensors[q + "eh_proj.weight"]
        out[p + "proj.weight"] = torch.cat([eh[:, cfg.dim :], eh[:, : cfg.dim]], 1)
    return {k: v.to(torch.float32).contiguous() for k, v in out.items()}


_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_IGNORED = ("rotary_emb.inv_freq",)  # buffers some writers save; wanka computes its own


def mtp_prefixes(cfg: ModelConfig) -> list[str]:
    """The HF name prefix of each MTP depth's layer (after the num_hidden_layers decoder ones)."""
    return [f"model.layers.{cfg.n_layers + d}." for d in range(cfg.mtp_depth)]


def without_absent_mtp(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> ModelConfig:
    """cfg without MTP when the file holds no tensor of any MTP layer: transformers runs no MTP
    and its save_pretrained drops those layers but keeps num_nextn_predict_layers. A partly
    present MTP layer stays in cfg, so check_tensors names what is missing."""
    prefixes = tuple(mtp_prefixes(cfg))
    if not prefixes or any(k.startswith(prefixes) for k in tensors):
        return cfg
    return dataclasses.replace(cfg, mtp_depth=0)


def check_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """One line naming the first tensor that is missing, has the wrong shape or a dtype wanka
    cannot load (quantized weights), holds NaN/Inf, or is more than the config.json describes."""
    from wanka.models.transformer import Transformer

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in to_hf(Transformer(cfg).state_dict(), cfg).items()}
    missing = [k for k in expected if k not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"does not match its config.json: tensor {missing[0]!r} is missing{more} "
                         "(a shard not downloaded, or a config.json of another model size?)")  # fmt: skip
    for k, shape in expected.items():
        _check_tensor(k, tensors[k], shape)
    _check_tied_head(tensors, cfg)
    # A tied model's file may still hold the copy some writers keep (equal to the embedding).
    tied_copy = {"lm_head.weight"} if cfg.tie_embeddings else set()
    extra = sorted(k for k in tensors
                   if k not in expected and not k.endswith(_IGNORED) and k not in tied_copy)  # fmt: skip
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ValueError(f"does not match its config.json: tensor {extra[0]!r}{more} is not part "
                         "of the model it describes (more layers or experts than config.json "
                         "says, or quantization scales?)")  # fmt: skip


def _check_tensor(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"does not match its config.json: tensor {name!r} has shape "
                         f"{list(t.shape)}, the config implies {list(shape)}")  # fmt: skip
    if t.dtype not in _FLOATS:
        raise ValueError(f"tensor {name!r} is {str(t.dtype).removeprefix('torch.')}: wanka "
                         "imports float32/bfloat16/float16 weights (dequantize the "
                         "checkpoint first)")  # fmt: skip
    if not torch.isfinite(t).all():  # a diverged run's or a damaged file's weights
        raise ValueError(f"tensor {name!r} holds NaN or Inf values: import a checkpoint of "
                         "finite weights (re-download it, or export an earlier checkpoint)")  # fmt: skip


def _check_tied_head(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """A tied model reads its output head from the embedding: a separate lm_head.weight that
    differs would be dropped without a word, and the model would compute something else."""
    head = tensors.get("lm_head.weight")
    if not cfg.tie_embeddings or head is None:
        return
    emb = tensors["model.embed_tokens.weight"]
    if head.shape != emb.shape or not torch.equal(head.float(), emb.float()):
        raise ValueError("does not match its config.json: tie_word_embeddings is true, but "
                         "lm_head.weight differs from model.embed_tokens.weight; set "
                         "tie_word_embeddings to false in config.json to import the separate "
                         "output head")  # fmt: skip


def read_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors or of the shards its index names."""
    from safetensors.torch import load_file

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            if not all(isinstance(f, str) for f in files):
                raise TypeError
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{index} is not a safetensors index (a JSON object with a "
                             "'weight_map' of tensor -> file): re-download or re-export it") from None  # fmt: skip
        for f in files:
            if not (hf_dir / f).is_file():
                raise ValueError(f"{hf_dir} lacks {f}, a shard its model.safetensors.index.json "
                                 "names: download every shard")  # fmt: skip
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{hf_dir} has no model.safetensors(.index.json): pass a Hugging Face "
                         "checkpoint directory")  # fmt: skip
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(hf_dir / f)))
        except Exception as e:  # safetensors' SafetensorError (truncated, bad header), OSError
            detail = " ".join(str(e).split())[:200] or type(e).__name__
            raise ValueError(f"{hf_dir / f} is not a readable safetensors file ({detail}): "
                             "re-download or re-export it") from None  # fmt: skip
    return tensors
