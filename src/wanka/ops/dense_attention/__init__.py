"""Dense causal attention and the indexer's KL target (attention_probs): every module here is a backend and registers itself on import."""

from wanka.ops.registry import import_backends

import_backends(__name__, __path__)
