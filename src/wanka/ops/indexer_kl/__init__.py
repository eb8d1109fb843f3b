from wanka.ops.indexer_kl import chunked, reference  # noqa: F401
