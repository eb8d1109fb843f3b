"""The Markdown table of `wanka bench ops`: reference and fast backend paired per shape."""

import json

from wanka.bench.ops_table import main, markdown_table


def row(backend, L=4096, k=512, pattern="random", **fig):
    return dict(
        op="sparse_attention", backend=backend, L=L, k=k, H=16, D=64, pattern=pattern, **fig
    )


def figures(fb, peak, **extra):
    return dict(fwd_s=fb / 3, fwd_bwd_s=fb, peak_mb=peak, **extra)


def test_pairs_reference_and_cpu_rows_of_one_shape():
    doc = {"cases": [
        row("reference", **figures(4.0, 2000)),
        row("cpu", **figures(1.0, 100, max_abs_err=2e-7, fraction_of_peak=0.25)),
        row("reference", L=32768, skipped="estimated 60.0 GiB > budget 12.0 GiB"),
        row("cpu", L=32768, **figures(9.0, 300, fraction_of_peak=0.2)),
        dict(op="dense_attention", backend="cpu", L=4096, H=16, D=64, error="killed"),
    ]}  # fmt: skip
    lines = markdown_table(doc).splitlines()
    assert len(lines) == 2 + 3  # header, rule, one row per shape
    small = next(x for x in lines if "| 4096 | 512 |" in x)
    assert "| 4.00x |" in small and "| 20x |" in small and "2.0e-07" in small and "25%" in small
    big = next(x for x in lines if "| 32768 |" in x)
    assert "estimated 60.0 GiB" in big and "(reference not rerun)" in big and "4.00x" not in big
    dense = next(x for x in lines if "dense_attention" in x)
    assert "failed: killed" in dense


def test_cli_names_an_unreadable_file(tmp_path, capsys):
    bad = tmp_path / "ops.json"
    bad.write_text("{not json")
    assert main([str(bad)]) == 2
    assert "cannot read" in capsys.readouterr().err
    bad.write_text("[]")
    assert main([str(bad)]) == 2
    assert "no 'cases' list" in capsys.readouterr().err
    bad.write_text(json.dumps({"cases": [row("cpu", **figures(1.0, 10))]}))
    assert main([str(bad)]) == 0
    assert "| sparse_attention | 4096 | 512 | random |" in capsys.readouterr().out
    bad.write_text(json.dumps({"cases": [{"op": "sparse_attention", "backend": "cpu", "L": 8}]}))
    assert main([str(bad)]) == 2
    assert "lacks" in capsys.readouterr().err
    only_gpu = {"cases": [row("triton", **figures(1.0, 10))]}
    assert len(markdown_table(only_gpu).splitlines()) == 2  # header and rule, nothing to pair
