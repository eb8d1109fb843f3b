"""DSA sparse attention in MLA's latent form (models/mla.py): every module here is a backend
and registers itself on import.

`mla_sparse_attention(q [B, Lq, H, C + R], kv [B, Lk, C + R], indices [B, Lq, K], scale,
rope_dim R) -> [B, Lq, H, C]`: MQA attention whose one key is the latent plus the RoPE key and
whose value is that same tensor, of which MLA reads only the latent part C (the output's RoPE
dims are never used, so backends need not compute them). This is the form fused MLA kernels
take (torch_npu's SparseFlashAttention: C = 512, R = 64). Index and query-suffix contract: as
`sparse_attention` (ops/sparse_attention/reference.py, `wanka.ops.registry`).
"""

from wanka.ops.registry import import_backends

import_backends(__name__, __path__)
