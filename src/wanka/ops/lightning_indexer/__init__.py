from wanka.ops.lightning_indexer import cpu, npu, reference  # noqa: F401
from wanka.ops.lightning_indexer import triton as _triton  # noqa: F401
