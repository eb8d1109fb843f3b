from wanka.ops.lightning_indexer import cpu, reference  # noqa: F401
