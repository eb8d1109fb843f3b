"""Compressed collectives attached through FSDP2's hooks: the gradient all-reduce across HSDP
replicas, and (optionally) the parameter all-gather.

With compression on, each FSDP module is sharded over its replica only (the 1D `shard` mesh)
and FSDP2 calls `set_all_reduce_hook`'s hook on the reduce-scatter output: this rank's flat
gradient shard of the whole module, summed over the replica. The hook sums it across replicas
(the `replicate` group: same shard index on every replica, i.e. across the slow link) in a
compressed form and writes the result back in place. Every replica ends with the same bits:
each method finishes with collectives whose outputs are identical on all ranks.

- bf16: cast, all-reduce, cast back (2x fewer bytes than fp32, no state).
- int8: blockwise absmax quantisation (one fp32 scale per `block` values), reduce-scatter as
  an all-to-all of int8 chunks + local dequantised sum, then an int8 all-gather of the summed
  chunks (ZeRO++'s qgZ shape). Both quantisations keep their error and add it back next step
  (error feedback), so the error does not accumulate into the weights.
- powersgd: each >= 2-D parameter shard M (rows x cols) is sent as rank-r factors P = M Q and
  Q = M^T P (Vogels et al., 2019), Q warm-started from the last step; the part of M outside
  the subspace is kept as error feedback. 1-D parameters and matrices too small to gain are
  all-reduced in fp32.

Int8AllGather (comm.param_gather = "int8", ZeRO++'s qwZ): FSDP2's parameter all-gather sends
each rank's shard as int8 + one fp32 scale per block (every parameter starts a new block) and
every rank dequantises the same bits, so all ranks compute with the same (rounded) weights;
master weights, gradients and optimizer state stay full precision.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    AllGather,  # see set_custom_all_gather
)

METHODS = ("none", "bf16", "int8", "powersgd")


class Bf16Reducer:
    def __init__(self, group) -> None:
        self.group = group

    def __call__(self, flat: torch.Tensor) -> None:
        low = flat.to(torch.bfloat16)
        dist.all_reduce(low, group=self.group)
        flat.copy_(low)


def block_aligned(sizes: list[int], block: int, numel: int) -> torch.Tensor | None:
    """Positions of a flat buffer of parameters of `sizes` in a copy where each parameter
    starts a new block (None when the sizes do not describe the buffer)."""
    if not sizes or sum(sizes) != numel:
        return None
    starts, pos = [], 0
    for size in sizes:
        starts.append(torch.arange(pos, pos + size))
        pos += -(-size // block) * block
    return torch.cat(starts)


def quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (numel divisible by block) -> (int8 values, fp32 scale per block)."""
    rows = x.view(-1, block)
    scale = rows.abs().amax(dim=1).clamp(min=1e-30) / 127.0
    q = torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.view(-1), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    return (q.view(-1, block).float() * scale[:, None]).view(-1)


class Int8Reducer:
    """Two-phase int8 all-reduce with error feedback on both quantisations. With the module's
    layout, every parameter starts a fresh block, so a small-gradient parameter (a norm
    weight) never shares a scale with a large one."""

    def __init__(self, group, block: int = 256, layout: list[torch.Size] | None = None) -> None:
        self.group, self.block = group, block
        self.sizes = [s.numel() for s in layout or []]
        self.n = dist.get_world_size(group)
        self.err: dict[int, torch.Tensor] = {}  # keyed by the flat size (one per layout)
        self.err_sum: dict[int, torch.Tensor] = {}

    def _blocked(self, numel: int) -> torch.Tensor | None:
        return block_aligned(self.sizes, self.block, numel)

    def __call__(self, flat: torch.Tensor) -> None:
        n, block, numel = self.n, self.block, flat.numel()
        where = self._blocked(numel)
        padded = numel if where is None else int(where[-1]) + 1
        chunk = -(-padded // (n * block)) * block  # each rank owns one chunk of whole blocks
        x = flat.new_zeros(n * chunk, dtype=torch.float32)
        if where is None:
            x[:numel] = flat
        else:
            x[where.to(flat.device)] = flat.float()
        err = self.err.setdefault(numel, torch.zeros_like(x))
        x += err
        q, scale = quantize_int8(x, block)
        err.copy_(x - dequantize_int8(q, scale, block))

        # Phase 1 (reduce-scatter): chunk j of every rank goes to rank j, which sums them.
        q_in, s_in = torch.empty_like(q), torch.empty_like(scale)
        dist.all_to_all_single(q_in, q, group=self.group)
        dist.all_to_all_single(s_in, scale, group=self.group)
        part = dequantize_int8(q_in, s_in, block).view(n, chunk).sum(0)
        err_sum = self.err_sum.setdefault(numel, torch.zeros_like(part))
        part += err_sum
        q2, s2 = quantize_int8(part, block)
        err_sum.copy_(part - dequantize_int8(q2, s2, block))

        # Phase 2 (all-gather) of the quantised sums: the same bits land on every rank.
        q_all = q2.new_empty(n * q2.numel())
        s_all = s2.new_empty(n * s2.numel())
        dist.all_gather_into_tensor(q_all, q2, group=self.group)
        dist.all_gather_into_tensor(s_all, s2, group=self.group)
        full = dequantize_int8(q_all, s_all, block)
        out = full[:numel] if where is None else full[where.to(flat.device)]
        if not torch.isfinite(out).all():  # a NaN/inf gradient must not poison later steps
            err.zero_(), err_sum.zero_()
        flat.copy_(out)


def module_layout(module: nn.Module) -> list[torch.Size]:
    """Per parameter of an FSDP module, the padded shard shape it occupies in the flat
    reduce-scatter output, in order (FSDP2 lays shards out back to back)."""
    state = module._get_fsdp_state()  # private: FSDP2 exposes no public layout of the buffer
    return [fp.padded_sharded_param_size for g in state._fsdp_param_groups for fp in g.fsdp_params]


class PowerSGDReducer:
    """Rank-r PowerSGD with error feedback over the parameters of one FSDP module."""

    def __init__(self, group, layout: list[torch.Size], rank: int = 4, seed: int = 0) -> None:
        self.group, self.rank, self.layout, self.seed = group, rank, layout, seed
        self.q: dict[int, torch.Tensor] = {}  # per matrix index: the warm-started Q
        self.err: dict[int, torch.Tensor] = {}  # keyed by the flat size

    def _matrices(self, numel: int) -> list[tuple[int, int, int, int]]:
        """(index, offset, rows, cols) of the pieces worth compressing; the layout is only
        trusted when it covers the buffer (a module whose parameters got no gradient this step
        reduces a shorter buffer: then the whole buffer goes uncompressed)."""
        if sum(s.numel() for s in self.layout) != numel:
            return []
        out, off = [], 0
        for i, shape in enumerate(self.layout):
            size = shape.numel()
            if len(shape) >= 2 and size:
                rows, cols = size // shape[-1], shape[-1]
                if self.rank * (rows + cols) * 2 <= rows * cols:  # at least 2x fewer values
                    out.append((i, off, rows, cols))
            off += size
        return out

    def _initial_q(self, index: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        # The same Q on every replica (seeded by the matrix index), so the P's add up.
        gen = torch.Generator().manual_seed(self.seed * 1000003 + index)
        return torch.randn(cols, self.rank, generator=gen).to(like)

    def __call__(self, flat: torch.Tensor) -> None:
        numel = flat.numel()
        m_all = flat.float()
        err = self.err.setdefault(numel, torch.zeros_like(m_all))
        m_all += err
        mats = self._matrices(numel)
        dense = torch.ones(numel, dtype=torch.bool, device=flat.device)
        views = []
        for _, off, rows, cols in mats:
            dense[off : off + rows * cols] = False
            views.append(m_all[off : off + rows * cols].view(rows, cols))
        qs = [self.q.setdefault(i, self._initial_q(i, cols, m_all)) for i, _, _, cols in mats]

        # P = M Q for all matrices, summed across replicas in one all-reduce.
        ps = [m @ q for m, q in zip(views, qs)]
        _all_reduce_list(ps, self.group)
        ps = [torch.linalg.qr(p).Q for p in ps]
        q_local = [m.t() @ p for m, p in zip(views, ps)]
        q_sum = [q.clone() for q in q_local]
        _all_reduce_list(q_sum, self.group)

        out = torch.empty_like(m_all)
        rest = m_all[dense]
        dist.all_reduce(rest, group=self.group)  # uncompressed pieces, fp32
        out[dense] = rest
        err.zero_()  # pieces sent uncompressed leave no error
        for (i, off, rows, cols), m, p, ql, qs_ in zip(mats, views, ps, q_local, q_sum):
            out[off : off + rows * cols] = (p @ qs_.t()).view(-1)
            err[off : off + rows * cols] = (m - p @ ql.t()).view(-1)
            # Warm start from this step's Q, unless it carries nothing (a zero or non-finite
            # gradient would otherwise pin Q, and every later P, at zero or NaN).
            if torch.isfinite(qs_).all() and qs_.abs().amax() > 0:
                self.q[i] = qs_
        if not torch.isfinite(out).all():
            err.zero_()
        flat.copy_(out)


def _all_reduce_list(tensors: list[torch.Tensor], group) -> None:
    if not tensors:
        return
    buf = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(buf, group=group)
    off = 0
    for t in tensors:
        t.copy_(buf[off : off + t.numel()].view_as(t))
        off += t.numel()


class Int8AllGather(AllGather):
    """FSDP2 custom all-gather: int8 blocks + fp32 scales on the wire, dequantised into the
    (in-place) all-gather output, this rank's own shard included."""

    def __init__(self, sizes: list[int], block: int = 256) -> None:
        self.sizes, self.block = sizes, block

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                 async_op: bool = False) -> None:  # fmt: skip
        numel, block = input_tensor.numel(), self.block
        where = block_aligned(self.sizes, block, numel)
        if where is None or not input_tensor.is_floating_point():  # nothing safe to quantise
            dist.all_gather_into_tensor(output_tensor, input_tensor, group=group)
            return None
        where = where.to(input_tensor.device)
        padded = -(-(int(where[-1]) + 1) // block) * block
        x = input_tensor.new_zeros(padded, dtype=torch.float32)
        x[where] = input_tensor.float()
        q, scale = quantize_int8(x, block)
        n = dist.get_world_size(group)
        q_all, s_all = q.new_empty(n * q.numel()), scale.new_empty(n * scale.numel())
        dist.all_gather_into_tensor(q_all, q, group=group)
        dist.all_gather_into_tensor(s_all, scale, group=group)
        full = dequantize_int8(q_all, s_all, block).view(n, padded)[:, where]
        output_tensor.copy_(full.reshape(-1))
        return None  # done synchronously: FSDP waits only on a returned Work


def make_reducer(method: str, group, module: nn.Module, *, powersgd_rank: int = 4,
                 int8_block: int = 256, seed: int = 0):  # fmt: skip
    if method == "bf16":
        return Bf16Reducer(group)
    if method == "int8":
        return Int8Reducer(group, int8_block, module_layout(module))
    if method == "powersgd":
        return PowerSGDReducer(group, module_layout(module), powersgd_rank, seed)
    raise ValueError(f"unknown gradient compression {method!r} (one of {', '.join(METHODS)})")
