"""`wanka bench decode`'s statistics over repeats: medians, and repeats that disagree flagged."""

from __future__ import annotations

from wanka.bench.decode import _median, _merge


def _case(tps: float, outputs: list[list[int]]) -> dict:
    return {"batch": 1, "speculate": 2, "seconds": 512 / tps, "tokens": 512, "tokens_per_s": tps,
            "latency_ms_per_token": 1e3 / tps, "outputs": outputs}  # fmt: skip


def test_median_of_odd_and_even_counts():
    assert _median([3.0, 1.0, 2.0]) == 2.0
    assert _median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert _median([7.0]) == 7.0


def test_merge_takes_medians_and_flags_disagreeing_repeats():
    same = [[1, 2, 3]]
    row = _merge([_case(100.0, same), _case(80.0, same), _case(120.0, same)])
    assert row["tokens_per_s"] == 100.0 and row["tokens_per_s_runs"] == [100.0, 80.0, 120.0]
    assert row["latency_ms_per_token"] == 10.0 and row["repeats_agree"] is True
    assert row["outputs"] == same
    row = _merge([_case(100.0, same), _case(90.0, [[1, 2, 4]])])
    assert row["repeats_agree"] is False and row["tokens_per_s"] == 95.0
