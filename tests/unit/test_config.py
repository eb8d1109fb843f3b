"""Configs: typed TOML, field-path errors with hints, overrides, flavors, round trip."""

import tomllib

import pytest

from wanka.config import ConfigError, dump_toml, load_config


def _write(tmp_path, text):
    p = tmp_path / "job.toml"
    p.write_text(text)
    return p


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(_write(tmp_path, "[train]\nsteps = 7\n"), ["train.lr=0.01", "run.dir=runs/x"])
    assert cfg.train.steps == 7 and cfg.train.lr == 0.01 and cfg.run.dir == "runs/x"
    assert cfg.model.flavor == "tiny"


def test_flavor_then_explicit_keys(tmp_path):
    cfg = load_config(_write(tmp_path, '[model]\nflavor = "small"\nn_layers = 3\n'))
    assert cfg.model.dim == 512 and cfg.model.n_layers == 3


@pytest.mark.parametrize(
    "text, path, fragment",
    [
        ("[train]\nstepz = 3\n", "train.stepz", "did you mean 'steps'"),
        ("[trian]\nsteps = 3\n", "trian", "did you mean 'train'"),
        ('[train]\nsteps = "many"\n', "train.steps", "expected int"),
        ("[train]\nsteps = true\n", "train.steps", "expected int"),
        ("[model]\nn_heads = 3\n", "model.n_heads", "do not divide model.dim"),
        ("[parallel]\nep = 3\n", "parallel.ep", "does not divide model.n_experts"),
        ('[model]\nflavor = "huge"\n', "model.flavor", "unknown flavor"),
        ('[train]\nphase = "warm"\n', "train.phase", "'sparse'"),
        ("[data]\nseq_len = 99999\n", "data.seq_len", "max_seq_len"),
        ("[train]\nmicro_batch_size = 0\n", "train.micro_batch_size", "positive"),
        # 1e12 passed and every rank then asked for 32 TB in its first backward.
        ("[comm]\nint8_block = 1000000000000\n", "comm.int8_block", "at most 4096"),
    ],
)
def test_bad_configs_name_the_field(tmp_path, text, path, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, text))
    assert e.value.path == path
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_bad_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["train.steps"])
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(_write(tmp_path, "[train\n"))
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'[run]\ndir = "runs/caf\xe9"\n')
    with pytest.raises(ConfigError, match=r"latin1.toml:2 is not UTF-8 text \(save it as UTF-8\)"):
        load_config(latin1)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ['model.flavor="small"', "train.steps=9", "checkpoint.async_save=true"])
    again = load_config(_write(tmp_path, dump_toml(cfg)))
    assert again == cfg
    assert tomllib.loads(dump_toml(cfg))["train"]["steps"] == 9


def test_empty_or_nul_paths_are_config_errors():
    """resilience.ledger="" passed `wanka check` and made train say "fault ledger . is
    unusable"; a NUL in run.dir was "embedded null byte" without the field."""
    for override, field, words in (('resilience.ledger=""', "resilience.ledger", "is empty"),
                                   ('data.cache_dir=" "', "data.cache_dir", "is empty"),
                                   ('run.dir="a\\u0000b"', "run.dir", "holds a NUL character")):  # fmt: skip
        with pytest.raises(ConfigError, match=f"{field}: {words}"):
            load_config(None, [override])


def test_cp_needs_enough_tokens_per_group_for_its_layout():
    """seq_len 3 at cp=4 started the ranks, then failed twice (a rank with no tokens)."""
    for layout, seq in (("head_tail", 7), ("dynamic", 3)):
        with pytest.raises(ConfigError, match="cannot give each of cp=4 ranks"):
            load_config(None, ["parallel.cp=4", f'parallel.cp_layout="{layout}"',
                               f"data.seq_len={seq}", "train.micro_batch_size=1"])  # fmt: skip
    load_config(None, ["parallel.cp=4", 'parallel.cp_layout="head_tail"', "data.seq_len=8",
                       "train.micro_batch_size=1"])  # fmt: skip
