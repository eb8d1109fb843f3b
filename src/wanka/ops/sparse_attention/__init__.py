from wanka.ops.sparse_attention import cpu, reference  # noqa: F401
