"""`wanka generate` and `wanka bench decode` on a run trained by `wanka train` (2 ranks, ep 2:
the checkpoint is sharded and must be resharded into one model)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from .helpers import wanka


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("gen") / "demo"
    r = wanka("train", "configs/demo.toml", "--nproc", "2", "--set", "train.steps=4",
              "--set", "train.eval_every=100", "--set", "checkpoint.every=2",
              "--set", "data.val_batches=1", "--set", "run.tensorboard=false",
              "--set", f'run.dir="{run}"')  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def test_loaded_model_is_the_trained_one(run_dir):
    """The resharded checkpoint predicts held-out text better than the initial weights do
    (after 4 steps the training loss is ~4.2 nats, a fresh init ~5.5)."""
    from wanka.bench.decode import heldout_prompts
    from wanka.infer.cache import KVCache
    from wanka.infer.load import load_trained

    model, cfg, ckpt = load_trained(run_dir)
    assert ckpt.name == "step-00000004"
    text = torch.tensor(heldout_prompts(4, 129))

    def loss(m) -> float:
        cache = KVCache(len(m.layers), 4, torch.device("cpu"))
        docs = cache.set_docs(0, torch.zeros(4, 128, dtype=torch.long))
        with torch.no_grad():
            logits = m.decode(text[:, :-1], torch.arange(128).expand(4, -1), cache, 0, docs)[0]
        return float(F.cross_entropy(logits.reshape(-1, 256), text[:, 1:].reshape(-1)))

    with torch.device("meta"):
        fresh = type(model)(cfg.model)
    fresh.to_empty(device="cpu")
    fresh.init_weights(cfg.train.seed)
    assert loss(model) < 5.0 < loss(fresh.eval())


def test_generate_streams_and_speculation_matches(run_dir, tmp_path):
    plain = wanka("generate", str(run_dir), "--prompt", "def main(", "--max-new-tokens", "24")
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert plain.stdout.startswith("def main(") and len(plain.stdout.encode()) > len("def main(")
    assert "tokens/s" in plain.stderr
    spec = wanka("generate", str(run_dir), "--prompt", "def main(", "--max-new-tokens", "24",
                 "--speculate", "2")  # fmt: skip
    assert spec.returncode == 0, spec.stderr[-2000:]
    assert spec.stdout == plain.stdout  # greedy: token for token
    assert "mean acceptance length" in spec.stderr

    prompts = tmp_path / "prompts.txt"
    prompts.write_text('import os\n{"prompt": "class A:"}\n\nThe \n')
    r = wanka("generate", str(run_dir), "--prompts", str(prompts), "--json", "--batch-size", "2",
              "--max-new-tokens", "6", "--temperature", "0.8", "--top-p", "0.9", "--speculate", "1")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["prompt"] for x in rows] == ["import os", "class A:", "The "]
    assert all(x["tokens"] == 6 for x in rows)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--prompt", "x", "--top-p", "0"], "top_p"),
        (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["--prompts", "/nonexistent/p.txt"], "prompts file /nonexistent/p.txt does not exist"),
        (["--prompt", "x", "--eos", "999"], "--eos"),
        (["--prompt", "x", "--checkpoint", "/nonexistent"], "not usable"),
    ],
)
def test_bad_generate_input_is_one_line(run_dir, args, fragment):
    r = wanka("generate", str(run_dir), *args)
    assert r.returncode == 2, r.stderr[-2000:]
    assert fragment in r.stderr and "Traceback" not in r.stderr


def test_generate_needs_a_trained_run(tmp_path):
    r = wanka("generate", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2 and "not a run directory" in r.stderr
    (tmp_path / "config.toml").write_text('[model]\nflavor = "tiny"\n')
    r = wanka("generate", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2 and "no complete checkpoint" in r.stderr, r.stderr


def test_bench_decode_writes_its_table(run_dir, tmp_path):
    out = tmp_path / "decode.json"
    r = wanka("bench", "decode", str(run_dir), "--prompts", "2", "--prompt-tokens", "32",
              "--new-tokens", "8", "--batches", "1,2", "--contexts", "96,192", "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [(c["batch"], c["speculate"]) for c in res["cases"]] == [(1, 0), (1, 2), (2, 0), (2, 2)]
    for c in res["cases"][1::2]:
        assert c["same_output_as_plain"] is True
        assert len(c["acceptance_rate"]) == 2 and c["mean_acceptance_length"] >= 1
        # the speed-up is the median of the 3 alternating pairs' ratios, inside their range
        low, high = c["speedup_range"]
        assert low <= c["speedup_vs_plain"] <= high
    for c in res["cases"]:
        assert len(c["tokens_per_s_runs"]) == res["repeats"] == 3 and c["repeats_agree"] is True
        runs = sorted(c["tokens_per_s_runs"])
        assert c["tokens_per_s"] == pytest.approx(runs[1], abs=0.01)
    assert [c["context"] for c in res["contexts"]] == [96, 192]
    assert res["sparse_step_growth"] > 0 and res["dense_step_growth"] > 0


def test_bench_decode_sampled_reports_acceptance_without_claiming_equal_output(run_dir, tmp_path):
    from wanka.infer.generate import distinct_4grams

    assert distinct_4grams([[7] * 12]) == pytest.approx(1 / 9, abs=1e-4)  # one 4-gram, 9 times
    assert distinct_4grams([list(range(12)), []]) == 1.0 and distinct_4grams([[1, 2]]) is None
    out = tmp_path / "decode.json"
    r = wanka("bench", "decode", str(run_dir), "--prompts", "2", "--prompt-tokens", "32",
              "--new-tokens", "8", "--batches", "1", "--contexts", "", "--temperature", "1",
              "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["temperature"] == 1.0 and not res["contexts"]
    plain, sped = res["cases"]
    assert sped["same_output_as_plain"] is None and "sampled" in r.stdout
    assert 0.0 <= sped["acceptance_rate"][1] <= 1.0 and sped["mean_acceptance_length"] >= 1
    assert 0.0 < plain["distinct_4grams"] <= 1.0
    for flag, value in (("--temperature", "-1"), ("--temperature", "nan"), ("--top-p", "0"),
                        ("--repeats", "0")):  # fmt: skip
        bad = wanka("bench", "decode", str(run_dir), flag, value, "--contexts", "")
        assert bad.returncode == 2 and f"{flag} " in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1
