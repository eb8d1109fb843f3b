"""A tiny MLA model written as a Hugging Face directory: the input of the bad-input tests of
`wanka import` / `export` / `generate` (damaged copies of it, or a run imported from it)."""

from __future__ import annotations

from pathlib import Path

import torch

from wanka.config.schema import ModelConfig
from wanka.interop.cli import write_hf
from wanka.models.transformer import Transformer

CFG = ModelConfig(attention="mla", vocab_size=256, dim=32, n_layers=2, n_heads=2,
                  q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                  v_head_dim=8, n_index_heads=2, index_head_dim=8, index_topk=8,
                  n_dense_layers=1, dense_hidden=32, n_experts=4, n_active_experts=2,
                  expert_hidden=16, n_shared_experts=1, mtp_depth=1, max_seq_len=64)  # fmt: skip


def write_tiny_hf(out: Path) -> Path:
    """CFG, initialised with seed 0, as a byte-tokenizer HF directory at `out` (created)."""
    with torch.device("meta"):
        m = Transformer(CFG)
    m.to_empty(device="cpu")
    m.init_weights(0)
    out.mkdir(parents=True)
    write_hf(m.state_dict(), CFG, "byte", out)
    return out


def imported_run(tmp: Path) -> Path:
    """A run directory imported (`wanka import`) from the tiny export written into tmp/hf."""
    from wanka.cli import main

    write_tiny_hf(tmp / "hf")
    assert main(["import", str(tmp / "hf"), "--out", str(tmp / "run")]) == 0
    return tmp / "run"


def one_line_error(capsys, argv: list[str], fragment: str) -> str:
    """`wanka ARGV` exits 2 with `fragment` in its last stderr line, no traceback, and nothing
    on stdout (no prompt echoed or half the batches printed before the error)."""
    from wanka.cli import main

    capsys.readouterr()
    assert main(argv) == 2
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and fragment in last, err
    assert out == "", out
    return last
