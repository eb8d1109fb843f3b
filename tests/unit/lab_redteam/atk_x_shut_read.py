"""Boundary (the evaluator's sends): the kernel walks its frames to the serving loop, answers
the forward half itself with the correct forward output, then shuts the reading side of the
server's socket and spins. Success: the evaluator's next send raises (BrokenPipeError
escaped evaluate() as a traceback, which also ended a whole `wanka lab run`)."""

import json
import socket
import sys

import torch


def kernel(x, weight, eps):
    f = sys._getframe(1)
    while f.f_code.co_name != "loop":
        f = f.f_back
    loc = f.f_locals
    sock, msg, bh = loc["sock"], loc["msg"], loc["backward_half"]
    cells = dict(zip(bh.__code__.co_freevars, (c.cell_contents for c in bh.__closure__)))
    buf = cells["put"].__self__
    xf = x.detach().float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)) * weight.detach()
    (meta,), _ = buf.put([y], msg["out_at"])
    sock.send(json.dumps({"ok": True, "phase": "forward", "outs": [meta]}).encode())
    sock.shutdown(socket.SHUT_RD)
    while True:
        pass  # the evaluator's deadline ends it
