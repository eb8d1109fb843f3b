import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
