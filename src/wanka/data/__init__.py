"""Data layer: built-in corpus, tokenizers, prepared token shards and the packing loader."""

from wanka.data.corpus import Document, builtin_documents, split_documents
from wanka.data.loader import Batch, PackedLoader, validation_batches
from wanka.data.prepare import (
    TokenDataset,
    ensure_builtin_dataset,
    main_prepare,
    prepare_documents,
    read_input_files,
)
from wanka.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "Batch",
    "ByteTokenizer",
    "Document",
    "HFTokenizer",
    "PackedLoader",
    "TokenDataset",
    "Tokenizer",
    "builtin_documents",
    "ensure_builtin_dataset",
    "load_tokenizer",
    "main_prepare",
    "prepare_documents",
    "read_input_files",
    "split_documents",
    "validation_batches",
]
