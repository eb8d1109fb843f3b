"""Packing loader: fixed-length windows over a shuffled stream of whole documents.

For epoch ``e`` the documents are permuted with ``np.random.default_rng([seed, e])`` and
conceptually concatenated into one stream. Window ``w`` covers stream tokens
``[w * seq_len, w * seq_len + seq_len + 1)``: inputs are the first ``seq_len``, labels the
next-token shift. Windows that would run past the end of the stream are dropped. The stream
is never materialised: ``np.searchsorted`` over cumulative document lengths locates tokens.

Every epoch has the same number of windows (the stream length does not depend on the
order), so the loader state is just (epoch, window) of the next global window. One call
consumes ``micro_batch_size * dp_size`` windows and rank ``r`` keeps rows
``[r * B, (r + 1) * B)``, which makes the state independent of ``dp_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from wanka.data.prepare import TokenDataset

IGNORE_INDEX = -100  # labels that must not be predicted (cross-document)


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, L] int64
    labels: torch.Tensor  # [B, L] int64, IGNORE_INDEX where the label is in another document
    positions: torch.Tensor  # [B, L] int64, restarts at each document fragment
    doc_ids: torch.Tensor  # [B, L] int32, 0, 1, 2, ... per fragment within the row

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            *(
                t.to(device, non_blocking=non_blocking)
                for t in (self.tokens, self.labels, self.positions, self.doc_ids)
            )
        )


class _Stream:
    """The documents of one split in a given order, addressable by stream position."""

    def __init__(self, dataset: TokenDataset, order: np.ndarray) -> None:
        self.dataset = dataset
        self.order = order
        self.cum = np.concatenate([[0], np.cumsum(dataset.doc_lengths[order])])

    def window(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens of stream positions [start, start + length) and their fragment ids (0, 1, ...)."""
        pos = np.arange(start, start + length, dtype=np.int64)
        # side="right" - 1: the last doc starting at or before pos (skips empty documents).
        k = np.searchsorted(self.cum, pos, side="right") - 1
        src = self.dataset.offsets[self.order[k]] + (pos - self.cum[k])
        frag = np.concatenate([[0], np.cumsum(k[1:] != k[:-1])])
        return self.dataset.tokens[src].astype(np.int64), frag


def _row(stream: _Stream, window: int, seq_len: int) -> tuple[np.ndarray, ...]:
    toks, frag = stream.window(window * seq_len, seq_len + 1)
    inputs, labels = toks[:-1], toks[1:].copy()
    labels[frag[1:] != frag[:-1]] = IGNORE_INDEX  # never predict across a document boundary
    frag = frag[:-1]
    starts = np.flatnonzero(np.concatenate([[True], frag[1:] != frag[:-1]]))
    positions = np.arange(seq_len, dtype=np.int64) - starts[frag]
    return inputs, labels, positions, frag.astype(np.int32)


def _stack(rows: list[tuple[np.ndarray, ...]]) -> Batch:
    return Batch(*(torch.from_numpy(np.stack(col)) for col in zip(*rows)))


def windows_per_epoch(dataset: TokenDataset, seq_len: int) -> int:
    return max(0, (dataset.num_tokens - 1) // seq_len)


def _check_args(seq_len: int, batch_size: int, dp_rank: int, dp_size: int) -> None:
    if seq_len < 1 or batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(
            f"bad loader args: seq_len={seq_len} batch_size={batch_size} "
            f"dp_rank={dp_rank} dp_size={dp_size}"
        )


class PackedLoader:
    """Infinite, resumable, data-parallel-sharded batches of packed training windows."""

    def __init__(
        self,
        dataset: TokenDataset,
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        _check_args(seq_len, micro_batch_size, dp_rank, dp_size)
        self.dataset = dataset
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.windows_per_epoch = windows_per_epoch(dataset, seq_len)
        if self.windows_per_epoch == 0:
            raise ValueError(
                f"{dataset.split} split of {dataset.path} has {dataset.num_tokens} tokens, "
                f"too few for one window of seq_len={seq_len} (a window reads seq_len + 1): "
                + (f"lower data.seq_len to {dataset.num_tokens - 1} or less, or add text"
                   if dataset.num_tokens > 1 else "add text to the corpus")
            )  # fmt: skip
        self.epoch = 0
        self.window = 0  # next global window index within the epoch
        self._stream: tuple[int, _Stream] | None = None  # cached layout of one epoch

    def _epoch_stream(self, epoch: int) -> _Stream:
        if self._stream is None or self._stream[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.dataset.num_docs)
            self._stream = (epoch, _Stream(self.dataset, order))
        return self._stream[1]

    def next_batch(self) -> Batch:
        g0 = self.epoch * self.windows_per_epoch + self.window
        first = g0 + self.dp_rank * self.micro_batch_size
        rows = []
        for g in range(first, first + self.micro_batch_size):
            epoch, w = divmod(g, self.windows_per_epoch)
            rows.append(_row(self._epoch_stream(epoch), w, self.seq_len))
        g_next = g0 + self.micro_batch_size * self.dp_size
        self.epoch, self.window = divmod(g_next, self.windows_per_epoch)
        return _stack(rows)

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "window": self.window,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "windows_per_epoch": self.windows_per_epoch,
            # A dataset prepared again from edited files often keeps its window count, and
            # the loader's position then means other text.
            "data_docs": int(self.dataset.num_docs),
            "data_tokens": int(self.dataset.num_tokens),
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "seq_len", "windows_per_epoch"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the checkpoint's data loader had {key}={state[key]}, this job's has "
                    f"{getattr(self, key)} (they follow data.path, data.seq_len and "
                    "train.seed): resume with the settings it was saved with, or start a new "
                    "run.dir from its weights with checkpoint.init_weights"
                )
        d0, t0 = state.get("data_docs"), state.get("data_tokens")  # (older: not recorded)
        d1, t1 = int(self.dataset.num_docs), int(self.dataset.num_tokens)
        if d0 is not None and (d0, t0) != (d1, t1):
            raise ValueError(
                f"the {self.dataset.split} split of {self.dataset.path} changed since the "
                f"checkpoint ({d0} documents / {t0} tokens then, {d1} / {t1} now: prepared "
                "again?): resume on the data it was trained on, or start a new run.dir from "
                "its weights with checkpoint.init_weights"
            )
        self.epoch = int(state["epoch"])
        self.window = int(state["window"])


def validation_batches(
    dataset_val: TokenDataset,
    seq_len: int,
    batch_size: int,
    num_batches: int,
    dp_rank: int,
    dp_size: int,
) -> list[Batch]:
    """A fixed set of val windows in document order, sharded like ``PackedLoader``.

    Global batch ``i`` is windows ``[i * G, (i + 1) * G)`` with ``G = batch_size * dp_size``;
    rank ``r`` keeps rows ``[r * batch_size, (r + 1) * batch_size)``. Returns fewer than
    ``num_batches`` batches when the split is too small (the same number on every rank).
    """
    _check_args(seq_len, batch_size, dp_rank, dp_size)
    global_batch = batch_size * dp_size
    windows = windows_per_epoch(dataset_val, seq_len)
    if dataset_val.num_docs == 0:
        raise ValueError(
            f"the val split of {dataset_val.path} is empty: `wanka data prepare` holds out whole "
            "documents and needs 2 or more (split a single file into several), with "
            "--val-fraction above 0"
        )
    if windows == 0:
        total = dataset_val.num_tokens + TokenDataset(dataset_val.path, "train").num_tokens
        fix = ("prepare it again with a larger --val-fraction (or --force), or lower "
               "data.seq_len") if total // 2 > seq_len else (
               f"lower data.seq_len below {total // 2}, or add text: validation holds at most "
               f"half of the {total} tokens")  # fmt: skip
        raise ValueError(
            f"val split of {dataset_val.path} has {dataset_val.num_tokens} tokens, fewer than "
            f"one window of seq_len={seq_len}: {fix}"
        )
    # A val split smaller than one global batch is read round-robin (windows repeat) rather
    # than refused: a small corpus still gets an evaluation, over every held-out window.
    n = max(1, min(num_batches, windows // global_batch))
    stream = _Stream(dataset_val, np.arange(dataset_val.num_docs))
    batches = []
    for i in range(n):
        first = i * global_batch + dp_rank * batch_size
        rows = [_row(stream, w % windows, seq_len) for w in range(first, first + batch_size)]
        batches.append(_stack(rows))
    return batches
