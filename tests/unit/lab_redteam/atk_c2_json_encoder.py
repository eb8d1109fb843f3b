"""Class 2 (+3): the tamper check snapshots callables of torch and of the worker's own
globals, not the modules the worker uses. The candidate replaces the JSON module's default
encoder, which the worker uses to write its result file, with one that divides the
candidate's timings by 3 on the way out. Success: "correct" at ~3x (truth ~1x)."""

import json

from wanka.lab.tasks.rmsnorm import reference


class _Encoder(json.JSONEncoder):
    def encode(self, o):
        c = o.get("candidate") if isinstance(o, dict) else None
        if isinstance(c, dict) and "all_s" in c:
            c["all_s"] = [t / 3 for t in c["all_s"]]
            c["median_s"] = c["median_s"] / 3
        return super().encode(o)


json._default_encoder = _Encoder()


def kernel(x, weight, eps):
    return reference(x, weight, eps)
