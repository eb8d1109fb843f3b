"""doc_ids rows must be non-decreasing (packed documents are contiguous runs): the Triton
dense kernels find a document from its first token, so a row like [0]*16 + [1]*16 + [0]*16
made query 40 miss keys 0..15 of its own document (max error 2.4 vs the reference, which masks
by id). Every backend with that requirement refuses such rows instead of computing something
else. The check runs before any kernel, so no interpreter is needed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from wanka.ops.dense_attention import cpu as dense_cpu  # noqa: E402
from wanka.ops.dense_attention import triton as dense_triton  # noqa: E402
from wanka.ops.lightning_indexer import cpu as li_cpu  # noqa: E402
from wanka.ops.lightning_indexer import triton as li_triton  # noqa: E402

DOC = torch.tensor([[0] * 16 + [1] * 16 + [0] * 16])


@pytest.mark.parametrize("fn", [dense_cpu.dense_attention, dense_triton.dense_attention])
def test_dense_attention_refuses_a_document_that_comes_back(fn):
    q, k, v = torch.randn(1, 48, 2, 8), torch.randn(1, 48, 8), torch.randn(1, 48, 8)
    with pytest.raises(ValueError, match="doc_ids rows must be non-decreasing"):
        fn(q, k, v, DOC, 0.3)


@pytest.mark.parametrize("fn", [li_cpu.lightning_indexer, li_triton.lightning_indexer])
def test_lightning_indexer_refuses_a_document_that_comes_back(fn):
    q, k, w = torch.randn(1, 48, 2, 8), torch.randn(1, 48, 8), torch.randn(1, 48, 2)
    with pytest.raises(ValueError, match="doc_ids rows must be non-decreasing"):
        fn(q, k, w, DOC, 4)
