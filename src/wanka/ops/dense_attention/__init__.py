from wanka.ops.dense_attention import cpu, probs_chunked, reference  # noqa: F401
from wanka.ops.dense_attention import triton as _triton  # noqa: F401
