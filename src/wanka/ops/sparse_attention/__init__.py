from wanka.ops.sparse_attention import reference  # noqa: F401
