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


def model_config(hf: dict, flavor: str = "tiny") -> ModelConfig:
    """The wanka ModelConfig of a deepseek_v32 config.json (every field explicit: `flavor`
    only names the preset a config.toml starts from)."""
    if hf.get("model_type") != MODEL_TYPE:
        raise ValueError(f"config.json has model_type {hf.get('model_type')!r}: wanka imports "
                         f"{MODEL_TYPE!r} checkpoints")  # fmt: skip
    rope = hf.get("rope_parameters") or {"rope_type": "default",
                                         "rope_theta": hf.get("rope_theta", 10000.0)}  # fmt: skip
    if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise ValueError("this checkpoint uses scaled RoPE (yarn), which wanka does not have: "
                         "import a checkpoint with rope_type 'default'")  # fmt: skip
    if hf.get("attention_bias"):
        raise ValueError("this checkpoint has attention biases, which wanka's MLA does not")
    if not hf.get("norm_topk_prob", True):
        raise ValueError("wanka always normalises the selected experts' weights "
                         "(norm_topk_prob = true); this checkpoint does not")  # fmt: skip
    try:
        return ModelConfig(
            flavor=flavor, attention="mla", vocab_size=hf["vocab_size"], dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
            head_dim=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(rope.get("rope_theta", 1e4)),
            max_seq_len=hf.get("max_position_embeddings", 4096),
            q_lora_rank=hf["q_lora_rank"], kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"], n_index_heads=hf["index_n_heads"],
            index_head_dim=hf["index_head_dim"], index_topk=hf["index_topk"],
            index_share_every=1, n_dense_layers=hf.get("first_k_dense_replace", 0),
            dense_hidden=hf["intermediate_size"], n_experts=hf["n_routed_experts"],
            n_active_experts=hf["num_experts_per_tok"],
            expert_hidden=hf["moe_intermediate_size"],
            n_shared_experts=hf.get("n_shared_experts", 0),
            route_scale=float(hf.get("routed_scaling_factor", 1.0)),
            n_expert_groups=hf.get("n_group", 1), n_limited_groups=hf.get("topk_group", 1),
            mtp_depth=hf.get("num_nextn_predict_layers", 0),
        )  # fmt: skip
    except KeyError as e:
        raise ValueError(
            f"config.json lacks {e.args[0]!r}, which a deepseek_v32 config has"
        ) from None


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


def read_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors or of the shards its index names."""
    from safetensors.torch import load_file

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{hf_dir} has no model.safetensors(.index.json): pass a Hugging Face "
                         "checkpoint directory")  # fmt: skip
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(hf_dir / f)))
    return tensors
