"""KV cache for decoding: per layer the post-RoPE keys, values and indexer keys of every slot.

Rows are right-aligned: all rows of a batch share one slot count, and a row shorter than the
longest is padded on the left with slots of document PAD_DOC, which no real query sees (the
attention ops mask keys of other documents). Right alignment is what the ops' query-suffix
contract needs: the new tokens of every row are the last slots. The document ids of a row
stay non-decreasing (pads, then the row's one document), as the CPU backends require.

Speculative decoding appends draft tokens and then keeps a prefix of them per row:
`keep(new_length, shifts)` truncates to the longest row and moves shorter rows right by their
shift, so the slots freed on the left become padding.
"""

from __future__ import annotations

import torch

PAD_DOC = -1  # document id of padding slots; a row's real tokens are document 0


class LayerCache:
    """One attention layer's slots: keys [B, S, D], values [B, S, D], indexer keys [B, S, Di]."""

    def __init__(self, owner: KVCache) -> None:
        self.owner = owner
        self.tensors: list[torch.Tensor] | None = None  # allocated at the first write

    def write(self, start: int, *parts: torch.Tensor | None) -> list[torch.Tensor | None]:
        """Store parts [B, Lq, *] at slots [start, start + Lq) -> views of slots [0, start + Lq)."""
        end = start + parts[0].shape[1]
        if self.tensors is None:
            cap = self.owner.capacity
            self.tensors = [None if p is None else p.new_zeros(p.shape[0], cap, *p.shape[2:])
                            for p in parts]  # fmt: skip
        self.owner.reserve(end)
        out = []
        for t, p in zip(self.tensors, parts):
            if t is None:
                out.append(None)
                continue
            t[:, start:end] = p
            out.append(t[:, :end])
        return out

    def _grow(self, capacity: int) -> None:
        if self.tensors is None:
            return
        grown = []
        for t in self.tensors:
            if t is None:
                grown.append(None)
                continue
            g = t.new_zeros(t.shape[0], capacity, *t.shape[2:])
            g[:, : t.shape[1]] = t
            grown.append(g)
        self.tensors = grown

    def _shift_rows(self, length: int, shifts: list[int]) -> None:
        if self.tensors is None:
            return
        for t in self.tensors:
            if t is not None:
                _shift(t, length, shifts, 0)


class KVCache:
    """The caches of n_layers attention layers (main layers, then MTP depths) and the document
    id of every slot, shared by all layers."""

    def __init__(self, n_layers: int, batch: int, device: torch.device, capacity: int = 256):
        self.capacity = capacity
        self.layers = [LayerCache(self) for _ in range(n_layers)]
        self.docs = torch.full((batch, capacity), PAD_DOC, dtype=torch.long, device=device)

    def reserve(self, end: int) -> None:
        """Make room for slots [0, end): capacity doubles, so appends are amortised O(1)."""
        if end <= self.capacity:
            return
        cap = self.capacity
        while cap < end:
            cap *= 2
        for layer in self.layers:
            layer._grow(cap)
        docs = self.docs.new_full((self.docs.shape[0], cap), PAD_DOC)
        docs[:, : self.capacity] = self.docs
        self.docs, self.capacity = docs, cap

    def set_docs(self, start: int, docs: torch.Tensor) -> torch.Tensor:
        """Document ids of slots [start, start + Lq) -> ids of slots [0, start + Lq)."""
        end = start + docs.shape[1]
        self.reserve(end)
        self.docs[:, start:end] = docs
        return self.docs[:, :end]

    def keep(self, length: int, shifts: list[int]) -> None:
        """Keep slots [0, length), moving row b right by shifts[b] slots (its last shifts[b]
        slots, rejected drafts, are dropped; its first shifts[b] become padding)."""
        if any(shifts):
            for layer in self.layers:
                layer._shift_rows(length, shifts)
            _shift(self.docs, length, shifts, PAD_DOC)
        self.docs[:, length:] = PAD_DOC


def _shift(t: torch.Tensor, length: int, shifts: list[int], fill) -> None:
    """In place: row b's slots [0, length - s) move to [s, length); [0, s) get `fill`. One
    gather over the rows that move."""
    rows = [b for b, s in enumerate(shifts) if s]
    if not rows:
        return
    r = torch.tensor(rows, device=t.device)
    s = torch.tensor([shifts[b] for b in rows], device=t.device)
    src = torch.arange(length, device=t.device)[None] - s[:, None]  # [R, length]
    view = t[r, :length]
    idx = src.clamp(min=0).view(*src.shape, *([1] * (t.dim() - 2))).expand_as(view)
    moved = torch.gather(view, 1, idx)
    moved[src < 0] = fill
    t[r, :length] = moved
