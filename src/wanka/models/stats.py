"""Parameter counts and the per-device memory estimate of a training job (no allocation).

The estimate follows what the trainer allocates, term by term, from the code (nothing is
fitted to measurements):

- sharded state (FSDP2, `distributed/parallelize.py`): fp32 master parameters, fp32 gradients
  and the two fp32 AdamW moments, each parameter sharded on dim 0 over `dp` (experts: over `ep`,
  then over dp/ep; FSDP2 pads dim 0 to a multiple of the shard count, which is modelled);
  replicated buffers (rope tables);
- gathered compute copies (compute dtype): the root module (embedding, head, final norm, MTP
  projections) stays gathered from the first forward to the end of backward; a block is gathered
  for its forward and again for its backward, with the next block prefetched in backward; with
  more than one shard the all-gather output buffer exists beside the copies while they are made;
- unsharded gradients of the block in backward (compute dtype) and the reduce-scatter input
  (reduce dtype) they are copied into;
- activations: what autograd saves for backward in each block, derived op by op from
  models/attention.py (MQA) or models/mla.py (MLA), models/moe.py, models/layers.py and the op
  backends (see `_block_saved`);
  with activation checkpointing, what the checkpoint keeps plus one block recomputed in backward;
- the DSA top-k indices (int64) the lightning indexer keeps for backward and hands to the next
  layers;
- logits: the fp32 log-probabilities cross-entropy saves (main head and each MTP depth), and
  the gradient buffers of the first cross-entropy backward;
- workspace: the largest transient of the op in flight at that moment (the chunked CPU ops'
  tiles, MoE dispatch/combine copies, activation gradients in backward, the optimizer step).

bf16 means FSDP2 mixed precision as distributed/parallelize.py applies it (bf16 parameters
gathered, compute in bf16 without autocast; RMSNorm statistics, RoPE, router scores, softmaxes
and losses in fp32, as the model code does). The fp32 path is validated against measured CPU
runs (bench/memory.py); the bf16 terms follow the same code but have not been measured on an
accelerator (the saved activations, MQA and MLA, fp32 and bf16, are checked against what
autograd keeps on CPU: tests/unit/test_memory_estimate.py).

Memory is not a sum of everything: the trainer's peak is a moment. The model walks the step
(forward block by block, loss, backward block by block in reverse, optimizer step, eval) and the
model's initialisation (the whole model is materialised in fp32 on every rank before sharding),
and reports the components at the largest moment. Process overhead (the interpreter, torch's
libraries, the CUDA context, the process group) is not the model's and not included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from wanka.config.schema import ModelConfig
from wanka.distributed.cp_dynamic import DEFAULT_SPAN_FACTOR as CP_SPAN_FACTOR
from wanka.distributed.cp_plan import DEFAULT_SLACK as CP_SLACK
from wanka.models.transformer import Transformer

GIB = 1024**3
MIB = 1024**2
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
AC_MODES = ("off", "full", "selective")
PHASES = ("sparse", "dense_warmup")
# Element budgets of the chunked ops' per-chunk tiles (kept in step with the op modules).
_OPS_CHUNK_ELEMS = 1 << 24  # lightning_indexer/cpu.py, dense_attention/probs_chunked.py
_SPARSE_GATHER_BUDGET = 1 << 22  # sparse_attention/cpu.py
COMPONENTS = (
    "master_params",  # fp32 sharded parameters + replicated buffers
    "adam_moments",  # fp32 exp_avg + exp_avg_sq, sharded like the parameters
    "grads",  # fp32 sharded gradients accumulated so far
    "gathered_params",  # unsharded compute-dtype copies in flight (+ all-gather buffers)
    "unsharded_grads",  # compute-dtype grads of the block in backward (+ reduce-scatter input)
    "activations",  # tensors saved for backward (top-k indices and logits apart)
    "topk_indices",  # int64 DSA indices [tokens, index_topk] per indexer layer
    "logits",  # fp32 log-probabilities saved by cross-entropy (+ their gradients)
    "workspace",  # transient tiles / copies / activation gradients of the op in flight
)


@dataclass
class ParamCounts:
    total: int
    active: int  # per token: non-expert params + the routed experts a token actually uses
    experts: int
    embedding: int


def count_params(cfg: ModelConfig) -> ParamCounts:
    with torch.device("meta"):
        model = Transformer(cfg)
    total = experts = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".experts." in name:
            experts += p.numel()
    active = total - experts + experts * cfg.n_active_experts // cfg.n_experts
    return ParamCounts(total, active, experts, model.tok_embeddings.weight.numel())


@dataclass(frozen=True)
class MemorySettings:
    """Everything besides the model that decides a rank's memory."""

    dp_shard: int = 1
    ep: int = 1
    seq_len: int = 4096
    micro_batch_size: int = 1
    compute_dtype: str = "bf16"  # gathered params and activations ("fp32" on CPU by default)
    reduce_dtype: str = "fp32"  # gradient reduce-scatter
    master_dtype: str = "fp32"  # sharded params, grads, AdamW moments
    activation_checkpointing: str = "off"
    device_type: str = "cuda"
    phase: str = "sparse"
    # Context parallelism: cp ranks share each sequence; a rank holds at most `cp_tokens`
    # tokens (0: micro_batch x seq_len / cp) and gathers keys over `cp_span` ranks (0: cp).
    cp: int = 1
    cp_tokens: int = 0
    cp_span: int = 0

    @property
    def tokens(self) -> int:
        """Tokens one rank runs through the model per micro-batch."""
        if self.cp == 1:
            return self.micro_batch_size * self.seq_len
        return self.cp_tokens or -(-self.micro_batch_size * self.seq_len // self.cp)

    def __post_init__(self) -> None:
        for name in ("compute_dtype", "reduce_dtype", "master_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"{name} must be one of {sorted(DTYPE_BYTES)}")
        if self.activation_checkpointing not in AC_MODES:
            raise ValueError(f"activation_checkpointing must be one of {AC_MODES}")
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}")
        if self.dp_shard < 1 or self.ep < 1 or self.dp_shard % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide parallel.dp_shard={self.dp_shard}")
        if self.cp < 1 or self.dp_shard % self.cp:
            raise ValueError(f"parallel.cp={self.cp} must divide the ranks {self.dp_shard}")

    def describe(self) -> str:
        return (f"dp_shard={self.dp_shard} x ep={self.ep}, seq_len={self.seq_len}, "
                f"micro_batch={self.micro_batch_size}, {self.master_dtype} master params/grads/"
                f"AdamW, {self.compute_dtype} compute copies and activations, "
                f"{self.reduce_dtype} grad reduce, activation checkpointing "
                f"{self.activation_checkpointing}, {self.device_type}, {self.phase} phase"
                + (f", cp={self.cp} ({self.tokens} tokens per rank, gather over "
                   f"{self.cp_span or self.cp} ranks)" if self.cp > 1 else ""))  # fmt: skip


@dataclass
class MemoryEstimate:
    settings: MemorySettings
    components: dict[str, float]  # bytes per component at the peak moment
    peak_at: str  # which moment of the step
    train_peak: float  # bytes: the largest moment of the training step
    init_peak: float  # bytes: model initialisation (full fp32 model before sharding)
    moments: dict[str, dict[str, float]] = field(default_factory=dict)  # components per moment
    notes: list[str] = field(default_factory=list)
    saved_by_part: dict[str, float] = field(default_factory=dict)  # all blocks, AC off

    def total_at(self, moment: str) -> float:
        return sum(self.moments[moment].values())

    @property
    def peak(self) -> float:
        return max(self.train_peak, self.init_peak)

    def gib(self) -> dict[str, float]:
        out = {k: v / GIB for k, v in self.components.items()}
        out["total"] = self.train_peak / GIB
        return out


# --------------------------------------------------------------------------------------------
# Parameters, grouped the way parallelize() groups them into FSDP units.


@dataclass
class _Unit:
    """One FSDP unit: `shapes` sharded over the dp mesh; `expert_shapes` (EP only) over ep,
    then dp/ep. `attn` / `ffn` split the block's params by where their grads appear."""

    name: str
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    expert_shapes: list[tuple[int, ...]] = field(default_factory=list)
    ffn_numel: int = 0  # numel of the unit's FFN / MoE params (experts included)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _shard_numel(shape: tuple[int, ...], n: int) -> int:
    """FSDP2's local shard of one parameter: dim 0 padded to a multiple of n."""
    if not shape:
        return 1
    return -(-shape[0] // n) * _numel(shape[1:])


def _units(cfg: ModelConfig, ep: int) -> tuple[_Unit, list[_Unit], int, int]:
    """(root, blocks in forward order: layers then MTP blocks, buffer bytes, largest param)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    root = _Unit("root")
    blocks = {f"layers.{i}.": _Unit(f"layer {i}") for i in range(cfg.n_layers)}
    blocks.update({f"mtp.{d}.block.": _Unit(f"mtp {d + 1}") for d in range(cfg.mtp_depth)})
    largest = 0
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        largest = max(largest, p.numel())
        prefix = next((k for k in blocks if name.startswith(k)), None)
        if prefix is None:
            root.shapes.append(shape)
            continue
        unit = blocks[prefix]
        if ".moe." in name or ".ffn." in name:
            unit.ffn_numel += p.numel()
        if ".experts." in name and ep > 1:
            unit.expert_shapes.append(shape)
        else:
            unit.shapes.append(shape)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return root, list(blocks.values()), buffers, largest


def _sharded(u: _Unit, dp: int, ep: int) -> int:
    n = sum(_shard_numel(s, dp) for s in u.shapes)
    for s in u.expert_shapes:  # Shard(0) over ep (ep divides n_experts), then FSDP over dp/ep
        n += _shard_numel((s[0] // ep, *s[1:]), dp // ep)
    return n


# --------------------------------------------------------------------------------------------
# Activations: bytes autograd saves for backward, op by op.


def _norm_saved(T: int, D: int, c: int) -> float:
    """RMSNorm (layers.py) on a [T, D] input whose output feeds linears (output saved).
    fp32: pow/mul save the input (counted as residual by the caller), y and rsqrt; the weight
    mul saves y; the next linear saves the output. bf16: x.float() is an fp32 copy (saved),
    y.to(bf16) is saved by the weight mul, the output by the linear; the input is not saved."""
    return T * D * (2 * c + (4 if c != 4 else 0)) + T * 4


def _kv_width(cfg: ModelConfig) -> int:
    """MLA's one key = value tensor per token, [latent | rope key]: also the per-head width of
    its absorbed queries and of the attention output."""
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim


def _mqa_saved(cfg: ModelConfig, T: int, c: int) -> float:
    """The attention part of _block_saved for models/attention.py (MQA)."""
    H, Dh = cfg.n_heads, cfg.head_dim
    return (T * 2 * Dh * c + T * (H + 1) * Dh * c + 2 * T * Dh * 4
            + T * H * Dh * c + T * H * 4)  # fmt: skip


def _mla_saved(cfg: ModelConfig, T: int, c: int) -> float:
    """The attention part of _block_saved for models/mla.py (MLAttention._project, _output;
    Dk = kv_lora_rank + qk_rope_head_dim, the K = V width):

      q latent   wq_a's output goes through q_norm (an RMSNorm whose output feeds wq_b and the
                 indexer's wq_b, one storage): _norm_saved, plus in fp32 its input (the pow's)
      q          wq_b's output [T, H (nope + rope)], kept whole by the absorption einsum's
                 q_nope view (its grad w.r.t. w_uk); the einsum's other input is wkv_b itself
      rope rows  fp32 cos/sin [T, rope] for q and for the rope key (the muls keep only those)
      kv latent  kv_norm on the latent view of wkv_a's output: fp32 keeps that whole output
                 [T, Dk] (the view's storage), bf16 its fp32 copy [T, kv_lora_rank]; rsqrt;
                 y (bf16: y.to(bf16)); its output only feeds the cat (nothing saved)
      attention  absorbed q [T, H, Dk], kv [T, Dk] once (k is v), out [T, H, Dk] and its lse
                 [T, H] fp32 (the sparse form slices the latent part of out: a view; the
                 output einsum keeps out's latent view, so out stays whole)
      wo input   the output einsum's [T, H, v_head_dim] result, copied by the reshape

    On an NPU the fused mla_sparse_attention keeps only out's latent part and its softmax
    statistics: not modelled, the generic path (the device's sparse_attention) is."""
    H, r, Dk = cfg.n_heads, cfg.qk_rope_head_dim, _kv_width(cfg)
    qr, kvr = cfg.q_lora_rank, cfg.kv_lora_rank
    q_latent = _norm_saved(T, qr, c) + (T * qr * c if c == 4 else 0)
    q = T * H * (cfg.qk_nope_head_dim + r) * c
    rope = 2 * T * r * 4
    kv_latent = (T * Dk * 4 if c == 4 else T * kvr * 4) + T * 4 + T * kvr * c
    attn = T * (H + 1) * Dk * c + T * H * Dk * c + T * H * 4
    return q_latent + q + rope + kv_latent + attn + T * H * cfg.v_head_dim * c


def _block_saved(cfg: ModelConfig, s: MemorySettings, has_indexer: bool, is_moe: bool) -> dict:
    """Bytes saved for backward by one Block.forward (models/transformer.py), by part.

    Derived from the code (T tokens, D dim, c compute bytes):
      residual      fp32 only: the block input and the mid-block residual (saved by the norms'
                    pow; in bf16 the norms save their own fp32 copies instead)
      norms         2 x RMSNorm (see _norm_saved)
      attention     MQA: wkv output [T, 2 Dh] (kept by the v view), q and k after rope, the
                    rope cos/sin rows (fp32 [T, Dh] per rope call), attention output [T, H, Dh]
                    and its log-sum-exp [T, H] fp32 (sparse_attention / dense_attention save
                    q, k, v, out, lse; wo saves out). MLA: see _mla_saved
      indexer       q [T, Hi, Di], k [T, Di], w [T, Hi], the layer_norm input and its fp32
                    mean/rstd, rope rows (MQA: Di wide; MLA: qk_rope_head_dim, the
                    attention's table); sparse: the KL's log_softmax
                    result and p (fp32 [T, K]) and its -inf mask (bool); dense (warm-up or
                    L <= K): indexer_kl saves its gradients dq, dk, dw instead
      indices       sparse: int64 [T, K] top-k indices and the [T] document starts
      router        sigmoid scores [T, E] fp32, top-k ids int64 [T, k] (gather), the routing
                    weights [T, k] fp32 (before and after normalisation) and the row sums
                    (top-k weights and the balance losses' probabilities)
      dispatch      the permutation indices (int64: index_select, index_copy; EP: regroup)
                    and the token copies [R, D] grouped by expert (R = T k rows with balanced
                    routing), saved by the experts op
      experts       grouped_swiglu (ops/grouped_experts): silu input, silu output, up
                    projection and their product, 4 [R, Hx]; the padded_bmm backend (CPU,
                    NPU) works on [E, cap, .] buffers (E cap >= R rows, = R when balanced)
                    and also keeps its padded input [E cap, D] and row slots (int64)
      combine       the expert outputs [R, D] (saved by moe_unpermute's index_copy; EP: also
                    the returned rows [T k, D]) and the weighting einsum's contiguous
                    [T, D, k] copy
      ffn           SwiGLU (dense layers and shared experts): 4 [T, hidden]
    """
    c = DTYPE_BYTES[s.compute_dtype]
    T, L = s.tokens, s.seq_len
    D = cfg.dim
    Hi, Di, K = cfg.n_index_heads, cfg.index_head_dim, cfg.index_topk
    sparse = L > K and s.phase == "sparse"
    mla = cfg.attention == "mla"
    out = {
        "residual": 2 * T * D * c if c == 4 else 0,
        "norms": 2 * _norm_saved(T, D, c),
        "attention": _mla_saved(cfg, T, c) if mla else _mqa_saved(cfg, T, c),
    }
    if s.cp > 1:
        # Segments that read their document's prefix from the gathered buffer keep a copy of
        # those keys (attention K and V, indexer keys) for backward: about a whole sequence
        # per rank (head-tail: chunks r and 2cp-1-r read (2cp+1)/2cp of each document).
        # MLA gathers its one K = V tensor once, but _core_cp indexes the gathered buffer for
        # k and for v (two copies): the sparse op keeps only k (mla_sparse_attention passes
        # it as both), dense_attention keeps both.
        kv = 2 * cfg.head_dim if not mla else _kv_width(cfg) * (1 if sparse else 2)
        out["attention"] += s.micro_batch_size * L * (kv + (Di if has_indexer else 0)) * c
    if has_indexer:
        proj = T * Hi * Di * c + T * Di * c + T * Hi * c  # q, k, w
        rope = cfg.qk_rope_head_dim if mla else Di  # MLA ropes the first qk_rope_head_dim dims
        ln_rope = T * Di * c + 2 * T * 4 + 2 * T * rope * 4  # LN input, mean/rstd, rope rows
        if sparse:
            out["indexer"] = proj + ln_rope + T * K * (4 + 4 + 1)
            out["indices"] = T * K * 8 + T * 8
        else:  # indexer_kl saves dq, dk, dw (same shapes as q, k, w)
            out["indexer"] = 2 * proj + ln_rope
    if is_moe:
        E, k, Hx = cfg.n_experts // s.ep, cfg.n_active_experts, cfg.expert_hidden
        R = T * k  # routed rows this rank's experts process (balanced routing)
        B, Eg = s.micro_batch_size, cfg.n_experts
        out["router"] = T * Eg * 4 + T * k * 8 + T * k * 4 + T * k * c + 2 * T * 4
        out["router"] += (B + 1) * Eg * 4  # the balance losses' load fractions (per row, batch)
        out["dispatch"] = 2 * T * k * 8 + (R * 8 if s.ep > 1 else 0) + R * D * c
        if _experts_backend(s) == "padded_bmm":
            Rp = E * -(-R // E)  # [E, cap, .] buffers, cap = the largest expert's rows
            out["experts"] = Rp * D * c + 4 * Rp * Hx * c + R * 8
        else:
            out["experts"] = 4 * R * Hx * c
        out["combine"] = R * D * c + (T * k * D * c if s.ep > 1 else 0) + T * k * D * c
        if cfg.n_shared_experts > 0:
            out["ffn"] = 4 * T * cfg.expert_hidden * cfg.n_shared_experts * c
    else:
        out["ffn"] = 4 * T * cfg.dense_hidden * c
    return out


_FFN_PARTS = ("router", "dispatch", "experts", "combine", "ffn")


def _experts_backend(s: MemorySettings) -> str:
    """The grouped_swiglu backend the registry picks: PyTorch's grouped GEMM on CUDA (sm90+,
    assumed for accelerators), the padded batched matmul elsewhere (it falls back to the
    unpadded grouped GEMM when routing is skewed; balanced routing is assumed here)."""
    return "grouped_mm" if s.device_type == "cuda" else "padded_bmm"


def _block_workspace(cfg: ModelConfig, s: MemorySettings, has_indexer: bool, is_moe: bool):
    """(forward, backward) transient bytes of the largest op in flight in one block.

    Forward: the chunked CPU ops' per-chunk tiles (lightning indexer [C Hi, span] scores,
    attention_probs [C, K, Dh] gathered keys + [C, H, K] fp32 scores), the indexer outputs and
    KL temporaries ([T, K]), the MoE expert output before its row gather and the combine buffer
    ([R, D] each; EP adds the all-to-all receive/return buffers).
    Backward: the incoming gradient [T, D] plus the largest of: MoE (gradients of the combine
    input, of the expert outputs and of the token copies, [R, D] each, and of the expert
    hiddens, 3 [R, Hx]), attention (dq and the wo input gradient [T, H, Dh], fp32 dk/dv), the
    indexer (dq, dk, dw and the backward tile), a dense FFN (4 [T, hidden]).
    MLA: Dh is the op's width kv_lora_rank + qk_rope_head_dim (absorbed queries, K = V); its
    forward transient is the larger einsum result (the absorbed no-rope query [T, H,
    kv_lora_rank] before its cat, or [T, H, v_head_dim] before wo's reshape copy); backward,
    the gradient of the output's latent slice comes back padded to Dh, and the op, called with
    k = v, returns fp32 dk and dv; under CP one K = V tensor is gathered. Like MQA's, these
    transients are read from the code, not checked against autograd or a measured peak."""
    c = DTYPE_BYTES[s.compute_dtype]
    T, L = s.tokens, s.seq_len
    mla = cfg.attention == "mla"
    D, H, Dh = cfg.dim, cfg.n_heads, _kv_width(cfg) if mla else cfg.head_dim
    Hi, Di, K = cfg.n_index_heads, cfg.index_head_dim, cfg.index_topk
    sparse = L > K and s.phase == "sparse"
    cpu = s.device_type == "cpu"
    if mla:
        fwd = [T * H * max(cfg.kv_lora_rank, cfg.v_head_dim) * c]
    else:
        fwd = [T * H * Dh * c]  # the attention output before wo
    bwd_attn = T * H * Dh * c * 2 + 2 * T * Dh * 4
    bwd = [bwd_attn]
    if has_indexer:
        if sparse:
            C = max(1, min(L, _OPS_CHUNK_ELEMS // max(1, Hi * L)))
            tile_idx = C * L * (Hi * c + c + 1) if cpu else C * L * 4  # triton: [C, span]
            Cp = max(1, min(L, _OPS_CHUNK_ELEMS // max(1, K * max(H, Dh))))
            tile_probs = Cp * K * (Dh * c + 2 * H * 4)
            kl_tmp = T * K * (c + 4 * 4)  # scores out, target, masked logq, xlogy, p*logq
            fwd += [tile_idx, tile_probs + T * K * c, kl_tmp]
            tile_bwd = C * L * (Hi * c + 4) if cpu else C * L * 4
            bwd.append(tile_bwd + T * (Hi * Di + Hi) * c + T * Di * 4)
        else:  # indexer_kl: [C, max(H, Hi), span] logits per block of queries
            C = max(1, min(L, _OPS_CHUNK_ELEMS // max(1, max(H, Hi) * L)))
            fwd.append(C * L * (max(H, Hi) * 4 * 2 + Hi * c))
    if s.cp > 1:
        # The all-gather of K, V and indexer keys: the padded local copy and the gathered
        # buffer forward; backward, its gradient and the reduce-scatter's contiguous input.
        width = (Dh if mla else 2 * Dh) + (Di if has_indexer else 0)
        g = (s.cp_span or s.cp) * T * width * c
        fwd.append(g + T * width * c)
        bwd.append(2 * g)
    if is_moe:
        R = T * cfg.n_active_experts
        fwd.append(2 * R * D * c + (R * D * c if s.ep > 1 else 0))
        bwd.append(3 * R * D * c + 3 * R * cfg.expert_hidden * c)
    else:
        bwd.append(4 * T * cfg.dense_hidden * c)
    return max(fwd), T * D * c + max(bwd)


def _head_saved(cfg: ModelConfig, s: MemorySettings) -> tuple[float, float, float]:
    """(main head, MTP depth before its block, MTP depth after its block) saved bytes,
    log-probs excluded.

    Main: token ids (embedding) and labels (cross-entropy), the final norm (input too in fp32).
    MTP depth, before the block: next-token ids, the next-token embedding (fp32: saved by
    embed_norm), hidden_norm and embed_norm (y and rsqrt: their outputs only feed torch.cat,
    which saves nothing), the cat [T, 2D] (saved by proj). After the block: the output norm
    (input too in fp32) and the labels."""
    c = DTYPE_BYTES[s.compute_dtype]
    T, D = s.tokens, cfg.dim
    norm_in = T * D * c if c == 4 else 0
    main = 2 * T * 8 + _norm_saved(T, D, c) + norm_in
    half_norm = T * D * (c + (4 if c != 4 else 0)) + T * 4  # y (+ fp32 copy) and rsqrt
    pre = T * 8 + norm_in + 2 * half_norm + T * 2 * D * c
    post = T * 8 + _norm_saved(T, D, c) + norm_in
    return main, pre, post


@dataclass
class _Seg:
    """One stretch of the forward: a block (an FSDP unit) or a head part."""

    name: str
    full: float  # bytes saved for backward without checkpointing (indices apart)
    kept: float  # bytes kept from its forward to its backward under the AC mode
    indices: float = 0.0
    logp: float = 0.0  # fp32 log-probabilities its cross-entropy saves
    unit: int | None = None  # index into the blocks (param units)
    ws: tuple[float, float] = (0.0, 0.0)  # forward, backward workspace
    recompute_indices: float = 0.0  # AC full: the indexer's indices computed again


def memory_breakdown(cfg: ModelConfig, s: MemorySettings) -> MemoryEstimate:
    """Per-device bytes of a training step and of initialisation (see the module docstring)."""
    c, r = DTYPE_BYTES[s.compute_dtype], DTYPE_BYTES[s.reduce_dtype]
    mb = DTYPE_BYTES[s.master_dtype]
    dp, ep = s.dp_shard, s.ep
    if cfg.n_experts % ep:
        raise ValueError(f"parallel.ep={ep} must divide model.n_experts={cfg.n_experts}")
    T, V, D = s.tokens, cfg.vocab_size, cfg.dim
    root, blocks, buffers, largest = _units(cfg, ep)
    shard = [_sharded(u, dp, ep) * mb for u in blocks]
    total_shard = _sharded(root, dp, ep) + sum(_sharded(u, dp, ep) for u in blocks)
    base = {"master_params": total_shard * mb + buffers, "adam_moments": total_shard * 2 * mb}

    def gathered(u: _Unit, copies: int = 1, buffer: int = 0) -> float:
        """`copies` x the unit's unsharded compute-dtype copies + `buffer` x its all-gather
        output (only where it has more than one shard: with one, FSDP2 copies the shard
        straight into the unsharded parameter)."""
        dpe = dp // ep
        g = sum(-(-x[0] // dp) * dp * _numel(x[1:]) if x else 1 for x in u.shapes)
        ge = sum(-(-(x[0] // ep) // dpe) * dpe * _numel(x[1:]) for x in u.expert_shapes)
        g_buf = g * (dp > 1) + ge * (dpe > 1)
        return ((g + ge) * copies + g_buf * buffer) * c

    root_g = gathered(root)
    ac = s.activation_checkpointing
    kinds = [(i % cfg.index_share_every == 0, i >= cfg.n_dense_layers) for i in range(cfg.n_layers)]
    kinds += [(False, False)] * cfg.mtp_depth  # MTP blocks: shared indices, dense FFN
    head_main, mtp_pre, mtp_post = _head_saved(cfg, s)
    logp = T * V * 4  # log_softmax result (fp32: logits.float())

    def block_seg(i: int) -> _Seg:
        f = _block_saved(cfg, s, *kinds[i])
        idx = f.pop("indices", 0)
        full = sum(f.values())
        kept = {"off": full, "full": T * D * c,  # full: the checkpoint keeps the block input
                "selective": sum(v for k, v in f.items() if k not in _FFN_PARTS)}[ac]  # fmt: skip
        return _Seg(blocks[i].name, full, kept, idx, unit=i,
                    ws=_block_workspace(cfg, s, *kinds[i]),
                    recompute_indices=idx if ac == "full" else 0)  # fmt: skip

    ce_fwd = T * V * c + (T * V * 4 if c != 4 else 0)  # logits (+ their fp32 copy)
    ce_bwd = 2 * logp + (T * V * c if c != 4 else 0)  # grads of log-probs and logits
    segs = [block_seg(i) for i in range(cfg.n_layers)]
    segs.append(_Seg("head", head_main, head_main, logp=logp, ws=(ce_fwd, ce_bwd)))
    for d in range(cfg.mtp_depth):
        segs.append(_Seg(f"mtp {d + 1} input", mtp_pre, mtp_pre))
        segs.append(block_seg(cfg.n_layers + d))
        segs.append(_Seg(f"mtp {d + 1} head", mtp_post, mtp_post, logp=logp, ws=(ce_fwd, ce_bwd)))

    moments: dict[str, dict[str, float]] = {}

    def moment(name: str, **parts: float) -> None:
        m = dict.fromkeys(COMPONENTS, 0.0)
        m.update(base)
        m.update(parts)
        moments[name] = m

    def held(j: int) -> float:
        """Under CP blocks stay unsharded from their forward to their backward
        (parallelize: reshard_after_forward=False): those of segments before j."""
        return (
            sum(gathered(blocks[x.unit]) for x in segs[:j] if x.unit is not None)
            if s.cp > 1
            else 0.0
        )

    def before(j: int) -> tuple[float, float, float]:
        return (sum(x.kept for x in segs[:j]), sum(x.indices for x in segs[:j]),
                sum(x.logp for x in segs[:j]))  # fmt: skip

    # Forward: the segment in flight with its block gathered. Under checkpointing a block's
    # forward saves nothing beyond what it keeps; its workspace is the same.
    for j, g in enumerate(segs):
        acts, idx, lp = before(j)
        # its copies, and its all-gather output (kept until the next block's copy-out)
        unit = gathered(blocks[g.unit], 1, 1) if g.unit is not None else 0
        moment(f"forward {g.name}", gathered_params=root_g + unit + held(j),
               activations=acts + (g.full if ac == "off" or g.unit is None else g.kept),
               topk_indices=idx + g.indices, logits=lp + g.logp, workspace=g.ws[0])  # fmt: skip
    # Backward, in reverse: the segment's saved tensors (recomputed under checkpointing), the
    # grads of the blocks done, the root's unsharded grads (head, embedding, MTP projections:
    # reduced only at the end), the block's copies and the next block's prefetch.
    root_grads = gathered(root)
    order = [j for j in range(len(segs) - 1, -1, -1)]
    unit_order = [segs[j].unit for j in order if segs[j].unit is not None]
    grads_done = 0.0
    for j in order:
        g = segs[j]
        acts, idx, lp = before(j)
        if g.unit is None:
            moment(f"backward {g.name}", gathered_params=root_g + held(j), grads=grads_done,
                   unsharded_grads=root_grads, activations=acts + g.full,
                   topk_indices=idx + g.indices, logits=lp + g.logp + (g.ws[1] if g.logp else 0),
                   workspace=0 if g.logp else g.ws[1])  # fmt: skip
            continue
        k = unit_order.index(g.unit)
        # the next block's prefetched all-gather output (copied out when its backward starts)
        nxt = gathered(blocks[unit_order[k + 1]], 0, 1) if k + 1 < len(unit_order) else 0
        nxt = 0 if s.cp > 1 else nxt  # under CP the earlier blocks are still unsharded
        u = blocks[g.unit]
        own = gathered(u)
        ffn_share = u.ffn_numel / max(1, sum(map(_numel, u.shapes + u.expert_shapes)))
        moment(f"backward {g.name}", gathered_params=root_g + own + nxt + held(j),
               grads=grads_done,
               unsharded_grads=root_grads + own * ffn_share, activations=acts + g.full,
               topk_indices=idx + g.indices + g.recompute_indices, logits=lp,
               workspace=g.ws[1])  # fmt: skip
        # After it: its unsharded grads are copied into the reduce-scatter input (reduce dtype)
        moment(f"reduce-scatter {g.name}", gathered_params=root_g + nxt + held(j),
               grads=grads_done,
               unsharded_grads=root_grads + own + own / c * r, activations=acts,
               topk_indices=idx, logits=lp)  # fmt: skip
        grads_done += shard[g.unit]
    # Optimizer step: every sharded grad exists; the update's temporaries (CPU: AdamW loops
    # over parameters, one at a time; accelerators: foreach over a group, at most all params).
    all_grads = total_shard * mb
    step_tmp = largest * mb / dp if s.device_type == "cpu" else all_grads
    moment("optimizer step", grads=all_grads, workspace=step_tmp)
    # Evaluation: a no_grad forward, one block gathered, the logits of one cross-entropy.
    moment("eval", gathered_params=root_g + max(gathered(u, 1, 1) for u in blocks),
           workspace=max(x.ws[0] for x in segs if x.unit is not None) + 3 * T * D * c,
           logits=T * V * (c + 4 + (4 if c != 4 else 0)))  # fmt: skip

    totals = {k: sum(v.values()) for k, v in moments.items()}
    peak_at = max(totals, key=totals.get)
    # Initialisation (trainer.setup): to_empty() materialises every parameter in fp32 on every
    # rank, init_weights() draws randn and scales it (two temporaries of the largest parameter),
    # then parallelize() shards.
    n_total = sum(_numel(x) for u in [root, *blocks] for x in u.shapes + u.expert_shapes)
    init = n_total * 4 + buffers + 2 * largest * 4
    notes = []
    for u in blocks:
        if u.expert_shapes and dp // ep > u.expert_shapes[0][0] // ep:
            local, dpe = u.expert_shapes[0][0] // ep, dp // ep
            notes.append(f"FSDP2 shards the experts on dim 0: {local} local experts over "
                         f"dp/ep={dpe} ranks are padded to {dpe} rows, so every rank holds a "
                         f"whole expert ({dpe / local:.1f}x its even share)")  # fmt: skip
            break
    if init > totals[peak_at]:
        notes.append("initialisation is the peak: trainer.setup materialises the whole model "
                     "in fp32 on every rank before sharding it")  # fmt: skip
    saved: dict[str, float] = {}
    for hi, moe in kinds:
        for k, v in _block_saved(cfg, s, hi, moe).items():
            saved[k] = saved.get(k, 0.0) + v
    return MemoryEstimate(s, moments[peak_at], peak_at, totals[peak_at], float(init), moments,
                          notes, saved)  # fmt: skip


def memory_estimate(
    cfg: ModelConfig,
    dp_shard: int,
    ep: int,
    seq_len: int,
    micro_batch_size: int,
    *,
    compute_dtype: str = "bf16",
    reduce_dtype: str = "fp32",
    master_dtype: str = "fp32",
    activation_checkpointing: str = "off",
    device_type: str = "cuda",
    phase: str = "sparse",
) -> dict[str, float]:
    """GiB per device at the training step's peak, by component, plus `total`;
    `params_and_optimizer` = fp32 master params (+ buffers) + AdamW moments."""
    s = MemorySettings(dp_shard, ep, seq_len, micro_batch_size, compute_dtype, reduce_dtype,
                       master_dtype, activation_checkpointing, device_type, phase)  # fmt: skip
    est = memory_breakdown(cfg, s)
    g = est.gib()
    out = {"params_and_optimizer": g.pop("master_params") + g.pop("adam_moments")}
    out.update(g)
    return out


def cp_limits(cp: int, layout: str, max_span: int, world_size: int, tokens: int) -> tuple[int, int]:
    """(the most tokens a rank may hold, 0 = tokens / cp; the widest gather block) of a
    context-parallel layout over `world_size` ranks, `tokens` per micro-batch of a dp group."""
    if cp == 1 or layout != "dynamic":
        return 0, cp
    cp_tokens = math.ceil(-(-tokens // cp) * (1 + CP_SLACK))  # cp_plan.plan_step's budget
    span = cp  # the widest gather block the plans may pick (cp_dynamic.assign_dynamic)
    limit = min(max_span or CP_SPAN_FACTOR * cp, world_size)
    while 2 * span <= limit and world_size % (2 * span) == 0:
        span *= 2
    return cp_tokens, span


def settings_for_job(cfg, world_size: int, device_type: str) -> list[MemorySettings]:
    """The settings a job (JobConfig) runs with on `world_size` ranks of `device_type`: one per
    training phase it goes through (a dense warm-up prefix, then sparse)."""
    from wanka.device import autocast_dtype

    t = cfg.train
    # FSDP shards over every rank of a replica's dp_shard x cp (all ranks without HSDP).
    par = cfg.parallel
    dp = world_size // par.dp_replicate if par.dp_shard == -1 else par.dp_shard * par.cp
    amp = autocast_dtype(device_type, t.mixed_precision)
    cp = cfg.parallel.cp
    cp_tokens, span = cp_limits(cp, cfg.parallel.cp_layout, cfg.parallel.cp_max_span, world_size,
                                t.micro_batch_size * cfg.data.seq_len)  # fmt: skip
    base = MemorySettings(
        cp=cp, cp_tokens=cp_tokens, cp_span=span,
        dp_shard=dp, ep=cfg.parallel.ep, seq_len=cfg.data.seq_len,
        micro_batch_size=t.micro_batch_size, compute_dtype="fp32" if amp is None else "bf16",
        reduce_dtype=t.reduce_dtype, activation_checkpointing=t.activation_checkpointing,
        device_type=device_type, phase="dense_warmup" if t.phase == "dense_warmup" else "sparse",
    )  # fmt: skip
    if t.phase == "sparse" and t.dense_warmup_steps > 0:
        return [replace(base, phase="dense_warmup"), base]
    return [base]


def job_memory(cfg, world_size: int, device_type: str) -> MemoryEstimate:
    """The largest estimate over the phases the job runs."""
    ests = [memory_breakdown(cfg.model, s) for s in settings_for_job(cfg, world_size, device_type)]
    return max(ests, key=lambda e: e.peak)
