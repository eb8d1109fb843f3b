"""Typed configs, one small dataclass per component.

The job file (TOML) has one table per dataclass in JobConfig. Model fields default to the
`tiny` flavor; `model.flavor` picks another preset and explicit keys override it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ModelConfig:
    flavor: str = "tiny"
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    head_dim: int = 32
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    init_std: float = 0.02
    # Attention form: "mqa" (one K and one V head of head_dim) or "mla" (DeepSeek-V3.2's
    # multi-head latent attention, run in MQA mode over the latent; models/mla.py).
    attention: Literal["mqa", "mla"] = "mqa"
    q_lora_rank: int = 64  # mla: query latent width
    kv_lora_rank: int = 64  # mla: key/value latent width (the cache holds it + the RoPE key)
    qk_nope_head_dim: int = 32  # mla: per-head query/key width without RoPE
    qk_rope_head_dim: int = 16  # mla: decoupled RoPE width (one RoPE key shared by the heads)
    v_head_dim: int = 32  # mla: per-head value width
    # DSA sparse attention: lightning indexer + top-k selection, MQA core attention.
    n_index_heads: int = 2
    index_head_dim: int = 16
    index_topk: int = 64
    index_share_every: int = 1
    # MoE FFN
    n_dense_layers: int = 1
    dense_hidden: int = 384
    n_experts: int = 8
    n_active_experts: int = 2
    expert_hidden: int = 128
    n_shared_experts: int = 1
    route_scale: float = 1.0
    bias_update_rate: float = 1e-3
    balance_loss_weight: float = 0.0  # batch-wise complementary balance loss
    seq_balance_loss_weight: float = 0.0  # DeepSeek-V3 sequence-wise auxiliary balance loss
    # Group-limited routing: experts form n_expert_groups groups (e.g. one per node); each
    # token picks its experts from at most n_limited_groups groups (DeepSeek-V3's n_group/topk_group).
    n_expert_groups: int = 1
    n_limited_groups: int = 1
    # Multi-token prediction
    mtp_depth: int = 1
    mtp_loss_weight: float = 0.3


@dataclass
class DataConfig:
    path: str = "builtin"
    tokenizer: str = "byte"
    cache_dir: str = ".cache/wanka"
    seq_len: int = 256
    val_batches: int = 8


@dataclass
class TrainConfig:
    steps: int = 300
    micro_batch_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    # "cosine": warm-up then cosine to min_lr_ratio at the horizon; "wsd": warm-up, stable at
    # lr, then a linear decay to min_lr_ratio over the last decay_fraction of the horizon.
    lr_schedule: Literal["cosine", "wsd"] = "cosine"
    lr_horizon: int = 0  # steps the schedule spans; 0 = train.steps
    decay_fraction: float = 0.2  # wsd: share of the horizon spent decaying
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    phase: Literal["sparse", "dense_warmup"] = "sparse"
    dense_warmup_steps: int = 0
    indexer_lr: float = 3e-3
    eval_every: int = 100
    log_every: int = 1
    # Compute dtype: "auto" = bf16 on accelerators, fp32 on CPU. With bf16, FSDP2 gathers
    # bf16 parameters (fp32 master weights and optimizer state stay sharded) and reduces
    # gradients in reduce_dtype.
    mixed_precision: Literal["auto", "fp32", "bf16"] = "auto"
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # Per-block activation checkpointing: "full" recomputes each block in backward;
    # "selective" keeps attention outputs and recomputes the FFN / MoE.
    activation_checkpointing: Literal["off", "full", "selective"] = "off"
    compile: bool = False  # torch.compile each block


@dataclass
class ParallelConfig:
    dp_shard: int = -1  # -1: whatever the world size leaves
    ep: int = 1
    cp: int = 1  # context parallel: ranks that share each sequence (cp innermost)
    # How a CP group splits its documents: contiguous chunks of each row, head-tail chunks of
    # each document, or a per-step cost-model plan over the whole dp x cp group.
    cp_layout: Literal["contiguous", "head_tail", "dynamic"] = "dynamic"
    # A `wanka bench cp` result whose fitted cost model the dynamic layout plans with
    # ("": the built-in estimate, with model.index_topk).
    cp_cost: str = ""
    # dynamic only: the most ranks one document may be split over (0: 4 x cp). A step whose
    # long documents sit in some dp groups' rows only spreads them over 2 cp, 4 cp, ... ranks
    # (cp x 2^k dividing the world; each rank of such a block all-gathers the block's keys);
    # cp keeps documents inside a CP group.
    cp_max_span: int = 0
    # HSDP: replicas of the sharded model (consecutive blocks of dp_shard x cp ranks, so with
    # one replica per node parameters are sharded inside a node and replicated across nodes:
    # the slow link carries one gradient all-reduce of a shard, not per-layer gathers).
    dp_replicate: int = 1

    def smallest_world(self) -> int:
        """The fewest ranks the degrees fit (dp_shard = -1 counts as 1): what `wanka train`
        and `wanka check` use when --nproc is not given."""
        import math

        if self.dp_shard > 0:
            return self.dp_replicate * self.dp_shard * self.cp
        return self.dp_replicate * math.lcm(self.ep, self.cp)  # ep must divide dp_shard x cp


@dataclass
class CommConfig:
    """Communication options (distributed/compression.py, docs/COMMUNICATION.md)."""

    # How gradients are all-reduced across HSDP replicas (parallel.dp_replicate > 1): "none"
    # (FSDP2's own all-reduce in train.reduce_dtype), "bf16", "int8" (blockwise, with error
    # feedback) or "powersgd" (rank-`powersgd_rank` factors, with error feedback).
    grad_compression: Literal["none", "bf16", "int8", "powersgd"] = "none"
    powersgd_rank: int = 4
    # powersgd: exact all-reduces for the first N steps, while gradients change fastest
    # (PyTorch's PowerSGD hook starts late too: start_powerSGD_iter).
    powersgd_start: int = 20
    int8_block: int = 256  # elements per int8 quantisation block (one fp32 scale each)
    # Explicit FSDP2 prefetch: each block's forward starts the all-gather of the next N blocks
    # (backward: the previous N), asynchronously, so it runs under the block's compute.
    # 0 = FSDP2's implicit prefetching.
    fsdp_prefetch: int = 0
    # FSDP2's parameter all-gather: "native" (param dtype) or "int8" (blockwise, ZeRO++'s
    # qwZ: 4x fewer bytes than fp32, every rank computes with the same rounded weights).
    param_gather: Literal["native", "int8"] = "native"
    # Expert all-to-all: "hierarchical" aggregates per node and crosses nodes once per node
    # pair and rail when an EP group spans nodes (same results; flat where it does not).
    expert_a2a: Literal["flat", "hierarchical"] = "flat"
    # Run the dispatch all-to-all asynchronously under the shared experts (flat exchange).
    ep_overlap: bool = False


@dataclass
class CheckpointConfig:
    enable: bool = True
    every: int = 100  # steps; 0 = Young/Daly interval from the measured save cost and MTBF
    mtbf_s: float = 86400.0  # assumed mean time between faults when the ledger has no history
    async_save: bool = False
    keep: int = 2
    load: str = "latest"  # "latest", "none", or a checkpoint directory
    # A new run starts from these weights (a checkpoint, or a run directory's newest): model
    # only, fresh optimizer, step 0, the data from its start (fine-tuning on other data).
    init_weights: str = ""


@dataclass
class RunConfig:
    dir: str = "runs/demo"
    device: str = "auto"
    ops_backend: str = ""  # "op=backend,..." forces op backends
    tensorboard: bool = True


@dataclass
class ResilienceConfig:
    """Supervisor, hang detection, in-memory snapshots, fault ledger (see docs/RESILIENCE.md)."""

    supervise: bool = True  # `wanka train --nproc N` runs under the supervisor
    snapshot_every: int = 1  # in-memory (shared-memory) snapshot every N steps; 0 = off
    snapshot_replica: bool = True  # copy each snapshot to a rank on another node
    # copy a snapshot into memory under the next step's forward and backward (which only read
    # the state), waiting for it before the optimizer step; false: copy in the step's stall
    snapshot_overlap: bool = True
    snapshot_dir: str = "/dev/shm/wanka"  # survives the training processes, not the node
    hang_factor: float = 3.0  # phase time-out = factor x longest observed duration ...
    hang_floor_s: float = 4.0  # ... but never below this
    hang_initial_s: float = 120.0  # before anything was observed (start-up, first step)
    max_restarts: int = 10  # retry budget of the supervisor
    no_progress_restarts: int = 3  # stop after this many restarts without a new step
    backoff_s: float = 0.5  # first back-off; doubles per consecutive failure
    backoff_max_s: float = 30.0
    ledger: str = ".cache/wanka/faults.sqlite"  # persistent fault ledger (SQLite)
    evict_after: int = 3  # evict a node after this many faults within evict_window_s ...
    evict_window_s: float = 3600.0
    evict_same_cause: int = 2  # ... or this many of the same node-level cause
    last_gasp: bool = True  # SIGTERM/SIGUSR1: all ranks stop at one step and checkpoint
    nan_guard: bool = True  # retry, then skip, a step with a non-finite loss or grad norm
    spike_factor: float = 0.0  # loss > factor x running mean = spike (0 = off)
    preflight: Literal["off", "static", "full"] = "static"  # before every (re)launch
    snapshot_max_age_h: float = 24.0  # snapshots of jobs idle this long are swept at start
    # How a --cluster supervisor watches the ranks: "files" (every node's heartbeats in the
    # shared run directory) or "store" (a node agent per node publishes its own ranks to a
    # control store running on one node; docs/RESILIENCE.md)
    control: Literal["files", "store"] = "files"
    # --cluster jobs: this many of the healthy nodes stand by as hot spares (with launchers
    # waiting if warm_launchers); one takes the place (and ranks) of a node named lost or hung.
    spare_nodes: int = 0
    # --cluster jobs with forked ranks: each attempt's node launchers start (and import torch)
    # while the attempt before trains, so a restart finds them ready. false: every attempt
    # starts its launchers cold (~2 CPU-s each), e.g. where nodes have no idle core for them.
    warm_launchers: bool = True


@dataclass
class PostConfig:
    """Post-training: `wanka distill` (on-policy distillation from domain teachers),
    `wanka rl` (GRPO with a verifiable reward), `wanka sft`, and `wanka draft` (MTP modules
    tuned to draft for their own main model); see docs/POST_TRAINING.md. Optimiser,
    steps, seed and logging come from [train], sharding from [parallel]."""

    init: str = ""  # run directory whose newest checkpoint the policy starts from
    teachers: str = ""  # distill: "domain=RUN_DIR,..." (one teacher per prompt domain)
    prompts: str = "builtin"  # "builtin" (code and prose domains) or a JSONL file
    domains: str = ""  # train and evaluate on these prompt domains only ("code,prose"); "": all
    prompt_seed: int = -1  # built-in prompts are drawn with this seed (-1: train.seed)
    prompt_chars: int = 96  # built-in prompts: characters of each prompt
    completion_tokens: int = 48  # tokens the policy samples per prompt
    prompts_per_step: int = 4  # per data-parallel rank
    samples_per_prompt: int = 1  # rl: the group size (>= 2)
    temperature: float = 1.0  # sampling; on-policy estimators assume 1.0
    top_p: float = 1.0
    # distill: per-token divergence to the teacher. reverse_kl (the student's own mistakes
    # are penalised where it makes them), forward_kl, or GKD's generalised JSD (beta).
    divergence: Literal["reverse_kl", "forward_kl", "jsd"] = "reverse_kl"
    estimator: Literal["exact", "sampled"] = "exact"  # reverse_kl: full vocabulary or sampled
    beta: float = 0.5  # jsd interpolation
    on_policy_fraction: float = 1.0  # GKD's lambda: else the corpus continuation is used
    # sft: completions to train on: the corpus continuations ("reference"), or samples of each
    # prompt's domain teacher ("teachers": sequence-level distillation).
    sft_source: Literal["reference", "teachers"] = "reference"
    reward: str = "python_parses"  # rl: a built-in reward or "package.module:function"
    clip_eps: float = 0.2  # rl: PPO ratio clip (acts when updates_per_batch > 1)
    updates_per_batch: int = 1  # rl: optimizer steps on each batch of samples (PPO epochs)
    kl_coef: float = 0.04  # rl: KL to the frozen initial policy
    speculate: int = 2  # draft: drafts per round of the held-out speculative decoding
    # draft: drafts per round the MTP module is trained for (draft 2.. on its own output,
    # EAGLE-3's training-time test); 0 = post.speculate, 1 = the first draft only
    draft_steps: int = 0
    eval_prompts: int = 16  # held-out prompts per domain for the eval


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    post: PostConfig = field(default_factory=PostConfig)
