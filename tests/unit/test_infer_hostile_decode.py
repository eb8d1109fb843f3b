"""Speculative decoding at the edge of max_seq_len, with rows that finish at different times."""

from __future__ import annotations

from wanka.infer.generate import Generator

from .test_decode import _expected, _oracle


def test_a_row_whose_last_drafts_were_cut_stays_within_the_position_table():
    """Row 0 keeps every draft, row 1 none. Row 0's last round keeps 3 drafts + 1 token where
    only 3 fit max_new_tokens: its position moved past the tokens it emitted, and the
    (ignored) verify forwards it still runs while row 1 goes on indexed RoPE at 64 of a
    64-row table: an IndexError (a device assert on GPU) for a request check() accepts
    (1 + 60 + 3 = max_seq_len)."""
    model = _oracle(max_seq_len=64)
    prompts = [[0], [40]]
    gen = Generator(model, speculate=3)
    assert gen.generate(prompts, 60) == [_expected(p, 60) for p in prompts]
