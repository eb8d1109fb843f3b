import pytest

from tests.distributed.helpers import small_job
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
    """small_job's overrides, the run dir named under this test's tmp_path."""

    def make(run_dir: str, *extra: str) -> list[str]:
        return small_job(dataset, tmp_path / run_dir, *extra)

    return make
