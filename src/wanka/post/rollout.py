"""Sampled completions as a training batch: one row per (prompt, completion), right-padded.

Logits at position t score targets[t] = tokens[t + 1]; `mask` marks the targets that are
completion tokens (the prompt is context, not trained on). Padding is a document of its own
(doc id 1), so real tokens never attend to it, and its targets are masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Samples:
    tokens: torch.Tensor  # [B, L] prompt + completion, then padding (0)
    positions: torch.Tensor  # [B, L]
    doc_ids: torch.Tensor  # [B, L] 0 = the sequence, 1 = padding
    targets: torch.Tensor  # [B, L] tokens shifted left by one
    mask: torch.Tensor  # [B, L] bool: targets[t] is a completion token
    no_labels: torch.Tensor  # [B, L] all -100: the model's own LM loss is not used here

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum())


def row_length(prompts: list[list[int]], completions: list[list[int]]) -> int:
    return max(len(p) + len(c) for p, c in zip(prompts, completions))


def assemble(prompts: list[list[int]], completions: list[list[int]],
             device: torch.device | str = "cpu", length: int | None = None) -> Samples:  # fmt: skip
    """length: pad every row to this many tokens (default: the longest row). Ranks that pad
    to one global length compute exactly what one rank holding all rows would."""
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    B = len(prompts)
    L = max(row_length(prompts, completions), length or 0)
    tokens = torch.zeros(B, L, dtype=torch.long)
    doc_ids = torch.ones(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.bool)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        n = len(p) + len(c)
        tokens[b, :n] = torch.tensor(p + c, dtype=torch.long)
        doc_ids[b, :n] = 0
        mask[b, len(p) - 1 : n - 1] = True  # the logits before each completion token
    positions = torch.arange(L).expand(B, L).clone()
    targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1))
    return Samples(tokens.to(device), positions.to(device), doc_ids.to(device),
                   targets.to(device), mask.to(device),
                   torch.full((B, L), -100, dtype=torch.long, device=device))  # fmt: skip
