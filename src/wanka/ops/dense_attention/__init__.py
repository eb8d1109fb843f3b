from wanka.ops.dense_attention import reference  # noqa: F401
