import pytest

from wanka.data.corpus import builtin_documents
from wanka.data.prepare import prepare_documents
from wanka.data.tokenizer import ByteTokenizer


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """A small real-text dataset (a slice of the built-in corpus), prepared once."""
    docs = builtin_documents()[:120]
    return prepare_documents(
        docs, tmp_path_factory.mktemp("data") / "ds", ByteTokenizer(), val_fraction=0.1
    )


@pytest.fixture
def job_args(dataset, tmp_path):
    """Overrides for a small, fast job on `dataset`; tests add their own."""

    def make(run_dir: str, *extra: str) -> list[str]:
        return [
            f'data.path="{dataset}"', "data.seq_len=96", "data.val_batches=1",
            "model.index_topk=16", "model.n_layers=3", "model.index_share_every=2",
            "train.steps=4", "train.warmup_steps=2", "train.eval_every=1000",
            "run.tensorboard=false", f'run.dir="{tmp_path / run_dir}"', *extra,
        ]  # fmt: skip

    return make
