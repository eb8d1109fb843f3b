from wanka.ops.sparse_attention import cpu, npu, reference  # noqa: F401
from wanka.ops.sparse_attention import triton as _triton  # noqa: F401
