from wanka.ops.dense_attention import cpu, reference  # noqa: F401
