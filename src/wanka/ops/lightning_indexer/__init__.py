from wanka.ops.lightning_indexer import reference  # noqa: F401
