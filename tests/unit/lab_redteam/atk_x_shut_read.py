"""Boundary (the evaluator's sends): the kernel walks its frames to the serving loop, answers
the forward half itself with the correct forward output, then shuts the reading side of the
server's socket and spins. Success: the evaluator's next send raises (BrokenPipeError
escaped evaluate() as a traceback, which also ended a whole `wanka lab run`)."""

import json
import socket
import sys

import torch

_held = []


def kernel(x, weight, eps):
    f = sys._getframe(1)
    while f.f_code.co_name != "loop":
        f = f.f_back
    sock = f.f_locals["sock"]
    xf = x.detach().float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)) * weight.detach()
    _held.append(y)
    meta = {"dtype": "float32", "shape": list(y.shape), "ptr": y.data_ptr()}
    sock.send(json.dumps({"ok": True, "phase": "forward", "outs": [meta]}).encode())
    sock.shutdown(socket.SHUT_RD)
    while True:
        pass  # the evaluator's deadline ends it
