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


class _Transactional:
    """Error-feedback state that a step changes only once the step is kept: __call__ stages
    the new state; commit() (or the next call) applies it, rollback() drops it, so a step the
    trainer recomputes or skips leaves no residual behind."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.staged: dict[str, torch.Tensor] | None = None

    def commit(self) -> None:
        if self.staged is not None:
            self.state.update(self.staged)
            self.staged = None

    def rollback(self) -> None:
        self.staged = None

    def layout(self) -> list:
        """What the state's shapes depend on: a saved state fits only an equal layout."""
        return []

    def state_dict(self) -> dict:
        """The kept error feedback (a staged step's is not kept yet), rank-local. Not copied:
        steps replace these tensors, never write into them, and both users (torch.save, the
        snapshot's copy into its slot) are done with them before the next step."""
        return {"kind": type(self).__name__, "layout": self.layout(),
                "state": {k: v.detach() for k, v in self.state.items()}}  # fmt: skip

    def load_state_dict(self, sd: dict) -> None:
        # Restored on the CPU (snapshots, torch.load): moved to the gradients' device at the
        # next call (_on).
        self.state = {k: v.clone() for k, v in sd["state"].items()}
        self.staged = None

    def reset(self) -> None:
        self.state, self.staged = {}, None

    def _on(self, device: torch.device) -> None:
        for k, v in self.state.items():
            if v.device != device:
                self.state[k] = v.to(device)


def reducer_states(model: nn.Module) -> list[dict]:
    """Every gradient reducer's error feedback on this rank, in module order ([] without
    compression): checkpoints and snapshots keep it, so a resumed compressed run continues
    bitwise where it stopped instead of restarting the residuals at zero."""
    return [r.state_dict() for r in getattr(model, "grad_reducers", ())]


def load_reducer_states(model: nn.Module, states: list[dict]) -> bool:
    """Restore what reducer_states saved; False (nothing changed) when the reducers differ."""
    reducers = list(getattr(model, "grad_reducers", ()))
    if len(states) != len(reducers) or any(
        s.get("kind") != type(r).__name__ or s.get("layout") != r.layout()
        for r, s in zip(reducers, states)
    ):
        return False
    for r, s in zip(reducers, states):
        r.load_state_dict(s)
    return True


def reset_reducer_states(model: nn.Module) -> None:
    """Every reducer as freshly built: no residuals, PowerSGD's exact warm-up from its start."""
    for r in getattr(model, "grad_reducers", ()):
        r.reset()


def _finite_or_zero(new: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    # Branch-free (no host sync): a NaN/inf gradient must not poison later steps.
    return torch.where(ok, new, torch.zeros_like(new))


class Bf16Reducer:
    def __init__(self, group) -> None:
        self.group = group

    def __call__(self, flat: torch.Tensor) -> None:
        low = flat.to(torch.bfloat16)
        dist.all_reduce(low, group=self.group)
        flat.copy_(low)

    def commit(self) -> None:  # stateless
        pass

    def rollback(self) -> None:
        pass

    def layout(self) -> list:
        return []

    def state_dict(self) -> dict:
        return {"kind": type(self).__name__, "layout": []}

    def load_state_dict(self, sd: dict) -> None:
        pass

    def reset(self) -> None:
        pass


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


class _AlignedIndex:
    """block_aligned's index on the buffer's device, built once per buffer size."""

    def __init__(self, sizes: list[int], block: int) -> None:
        self.sizes, self.block = sizes, block
        self.cache: dict[tuple[int, torch.device], tuple[torch.Tensor | None, int]] = {}

    def __call__(self, numel: int, device: torch.device) -> tuple[torch.Tensor | None, int]:
        """(positions or None, padded size rounded up to whole blocks)."""
        key = (numel, device)
        if key not in self.cache:
            where = block_aligned(self.sizes, self.block, numel)
            padded = numel if where is None else int(where[-1]) + 1
            padded = -(-padded // self.block) * self.block
            self.cache[key] = (None if where is None else where.to(device), padded)
        return self.cache[key]


def quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (numel divisible by block) -> (int8 values, fp32 scale per block)."""
    rows = x.view(-1, block)
    scale = rows.abs().amax(dim=1).clamp(min=1e-30) / 127.0
    q = torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.view(-1), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    return (q.view(-1, block).float() * scale[:, None]).view(-1)


def _pack(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[n, chunk] int8 values + [n, blocks] fp32 scales -> one [n, chunk + 4 blocks] int8
    message per destination (one collective instead of two)."""
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=1)


def _unpack(packed: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = packed[:, :chunk].reshape(-1)
    scale = packed[:, chunk:].contiguous().view(torch.float32).reshape(-1)
    return q, scale


class Int8Reducer(_Transactional):
    """Two-phase int8 all-reduce with error feedback on both quantisations. With the module's
    layout, every parameter starts a fresh block, so a small-gradient parameter (a norm
    weight) never shares a scale with a large one."""

    def __init__(self, group, block: int = 256, layout: list[torch.Size] | None = None) -> None:
        super().__init__()
        self.group, self.block = group, block
        self.n = dist.get_world_size(group)
        self.sizes = [s.numel() for s in layout or []]
        self.index = _AlignedIndex(self.sizes, block)

    def layout(self) -> list:
        return [self.block, self.n, *self.sizes]

    def __call__(self, flat: torch.Tensor) -> None:
        self.commit()  # the previous step's, if nobody did
        self._on(flat.device)
        n, block, numel = self.n, self.block, flat.numel()
        where, padded = self.index(numel, flat.device)
        chunk = -(-padded // (n * block)) * block  # each rank owns one chunk of whole blocks
        x = flat.new_zeros(n * chunk, dtype=torch.float32)
        if where is None:
            x[:numel] = flat
        else:
            x[where] = flat.float()
        if self.state.get("err") is not None and self.state["err"].numel() == x.numel():
            x += self.state["err"]
        q, scale = quantize_int8(x, block)
        err = x - dequantize_int8(q, scale, block)

        # Phase 1 (reduce-scatter): chunk j of every rank (values and their scales in one
        # message) goes to rank j, which sums them.
        packed = _pack(q.view(n, chunk), scale.view(n, chunk // block))
        received = torch.empty_like(packed)
        dist.all_to_all_single(received, packed, group=self.group)
        q_in, s_in = _unpack(received, chunk)
        part = dequantize_int8(q_in, s_in, block).view(n, chunk).sum(0)
        if self.state.get("err_sum") is not None and self.state["err_sum"].numel() == chunk:
            part += self.state["err_sum"]
        q2, s2 = quantize_int8(part, block)
        err_sum = part - dequantize_int8(q2, s2, block)

        # Phase 2 (all-gather) of the quantised sums: the same bits land on every rank.
        mine = _pack(q2[None], s2[None])
        gathered = mine.new_empty((n, mine.shape[1]))
        dist.all_gather_into_tensor(gathered, mine, group=self.group)
        full = dequantize_int8(*_unpack(gathered, chunk), block)
        out = full[:numel] if where is None else full[where]
        ok = torch.isfinite(out).all()
        self.staged = {"err": _finite_or_zero(err, ok), "err_sum": _finite_or_zero(err_sum, ok)}
        flat.copy_(out)


def module_layout(module: nn.Module) -> list[torch.Size]:
    """Per parameter of an FSDP module, the padded shard shape it occupies in the flat
    reduce-scatter output, in order (FSDP2 lays shards out back to back)."""
    state = module._get_fsdp_state()  # private: FSDP2 exposes no public layout of the buffer
    return [fp.padded_sharded_param_size for g in state._fsdp_param_groups for fp in g.fsdp_params]


class PowerSGDReducer(_Transactional):
    """Rank-r PowerSGD with error feedback over the parameters of one FSDP module. A 2-D
    shard is one matrix; a 3-D one (stacked experts, [E, h, d]) is E matrices of h x d, each
    with its own rank-r factors (batched), so experts do not share one subspace."""

    def __init__(self, group, layout: list[torch.Size], rank: int = 4, seed: int = 0,
                 start: int = 0) -> None:  # fmt: skip
        super().__init__()
        self.group, self.rank, self.shapes, self.seed = group, rank, layout, seed
        self.start, self.kept = start, 0  # exact all-reduces before the first compressed one
        self.numel = sum(s.numel() for s in layout)
        self.mats, self.dense = self._plan()

    def _plan(self) -> tuple[list[tuple[int, int, int, int, int]], list[tuple[int, int]]]:
        """(index, offset, batch, rows, cols) of the pieces worth compressing, and (offset,
        size) runs of the rest, sent uncompressed."""
        mats, dense, off = [], [], 0
        for i, shape in enumerate(self.shapes):
            size = shape.numel()
            batch = shape[0] if len(shape) == 3 else 1
            rows, cols = (shape[-2], shape[-1]) if len(shape) >= 2 else (0, 0)
            if len(shape) in (2, 3) and size and self.rank * (rows + cols) * 2 <= rows * cols:
                mats.append((i, off, batch, rows, cols))
            elif size:
                if dense and dense[-1][0] + dense[-1][1] == off:
                    dense[-1] = (dense[-1][0], dense[-1][1] + size)
                else:
                    dense.append((off, size))
            off += size
        return mats, dense

    def _initial_q(self, index: int, batch: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        # The same Q on every replica (seeded by the matrix index), so the P's add up.
        gen = torch.Generator().manual_seed(self.seed * 1000003 + index)
        return torch.randn(batch, cols, self.rank, generator=gen).to(like)

    def commit(self) -> None:
        if self.staged is not None:
            self.kept += 1
        super().commit()

    def layout(self) -> list:
        return [self.rank, dist.get_world_size(self.group), *(list(s) for s in self.shapes)]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "kept": self.kept}

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self.kept = int(sd["kept"])

    def reset(self) -> None:
        super().reset()
        self.kept = 0

    def __call__(self, flat: torch.Tensor) -> None:
        self.commit()
        self._on(flat.device)
        numel = flat.numel()
        if numel != self.numel or self.kept < self.start:
            # Not this module's layout (nothing safe to factor), or still in the first steps,
            # where gradients change fastest (PyTorch's hook: start_powerSGD_iter).
            dist.all_reduce(flat, group=self.group)
            self.staged = {}
            return
        m_all = flat.float().clone()
        if self.state.get("err") is not None:
            m_all += self.state["err"]
        views = [m_all[o : o + b * r * c].view(b, r, c) for _, o, b, r, c in self.mats]
        qs = [self.state.get(f"q{i}") for i, *_ in self.mats]
        qs = [q if q is not None else self._initial_q(i, b, c, m_all)
              for q, (i, _, b, _, c) in zip(qs, self.mats)]  # fmt: skip

        # P = M Q for all matrices, summed across replicas in one all-reduce together with
        # the pieces sent uncompressed (fp32).
        ps = [m @ q for m, q in zip(views, qs)]
        rest = [m_all[o : o + n].clone() for o, n in self.dense]
        _all_reduce_list(ps + rest, self.group)
        ps = [torch.linalg.qr(p).Q for p in ps]  # batched: one basis per matrix
        q_local = [m.transpose(1, 2) @ p for m, p in zip(views, ps)]
        q_sum = [q.clone() for q in q_local]
        _all_reduce_list(q_sum, self.group)

        out = torch.empty_like(m_all)
        err = torch.zeros_like(m_all)  # pieces sent uncompressed leave no error
        for (o, n), r in zip(self.dense, rest):
            out[o : o + n] = r
        staged = {}
        for (i, o, b, r, c), m, p, ql, qs_, q_old in zip(self.mats, views, ps, q_local, q_sum, qs):
            out[o : o + b * r * c] = (p @ qs_.transpose(1, 2)).reshape(-1)
            err[o : o + b * r * c] = (m - p @ ql.transpose(1, 2)).reshape(-1)
            # Warm start from this step's Q, unless it carries nothing (a zero or non-finite
            # gradient would otherwise pin Q, and every later P, at zero or NaN).
            usable = torch.isfinite(qs_).all() & (qs_.abs().amax() > 0)
            staged[f"q{i}"] = torch.where(usable, qs_, q_old)
        staged["err"] = _finite_or_zero(err, torch.isfinite(out).all())
        self.staged = staged
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
        self.block = block
        self.index = _AlignedIndex(sizes, block)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                 async_op: bool = False) -> None:  # fmt: skip
        numel, block = input_tensor.numel(), self.block
        where, padded = self.index(numel, input_tensor.device)
        if where is None or not input_tensor.is_floating_point():  # nothing safe to quantise
            dist.all_gather_into_tensor(output_tensor, input_tensor, group=group)
            return None
        x = input_tensor.new_zeros(padded, dtype=torch.float32)
        x[where] = input_tensor.float()
        q, scale = quantize_int8(x, block)
        n = dist.get_world_size(group)
        mine = _pack(q[None], scale[None])
        gathered = mine.new_empty((n, mine.shape[1]))
        dist.all_gather_into_tensor(gathered, mine, group=group)
        full = dequantize_int8(*_unpack(gathered, padded), block).view(n, padded)[:, where]
        output_tensor.copy_(full.reshape(-1))
        return None  # done synchronously: FSDP waits only on a returned Work


def make_reducer(method: str, group, module: nn.Module, *, powersgd_rank: int = 4,
                 powersgd_start: int = 0, int8_block: int = 256, seed: int = 0):  # fmt: skip
    if method == "bf16":
        return Bf16Reducer(group)
    if method == "int8":
        return Int8Reducer(group, int8_block, module_layout(module))
    if method == "powersgd":
        return PowerSGDReducer(group, module_layout(module), powersgd_rank, seed, powersgd_start)
    raise ValueError(f"unknown gradient compression {method!r} (one of {', '.join(METHODS)})")
