import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; triton reads this
# once, when first imported, so it is set before any test module imports wanka.ops.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
