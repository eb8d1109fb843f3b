"""Dense projection `linear(x [..., in], weight [out, in], bias [out] | None) -> [..., out]`,
as torch's F.linear: every module here is a backend and registers itself on import."""

from wanka.ops.registry import import_backends

import_backends(__name__, __path__)
