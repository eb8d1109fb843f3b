"""Class 3: the parent believes the roofline peaks and timings the child reports. From the
harness's frames the candidate raises the peaks it measured to 1e18 (no roofline left) and
divides its recorded durations by 100. Success: "correct" at ~100x (truth ~1x)."""

import sys

from wanka.lab.tasks.rmsnorm import reference

_done: dict = {}


def _rewrite():
    f = sys._getframe(1)
    while f is not None:
        loc = f.f_locals
        res = loc.get("res")
        if f.f_code.co_name == "run" and isinstance(res, dict) and "peaks" in res:
            res["peaks"] = {"flops": 1e18, "bytes_per_s": 1e18}
        durs = loc.get("durs")
        if f.f_code.co_name == "time_fns" and isinstance(durs, dict) and "candidate" in durs:
            d = durs["candidate"]
            for i in range(_done.get(id(d), 0), len(d)):
                d[i] = d[i] / 100
            _done[id(d)] = len(d)
        f = f.f_back


def kernel(x, weight, eps):
    _rewrite()
    return reference(x, weight, eps)
