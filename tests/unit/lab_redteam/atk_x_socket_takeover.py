"""Boundary (the serving loop's socket): the kernel walks its frames to the serving loop and
serves every call itself from then on: the reference's forward, sent as the forward half;
then, given the upstream gradient, the very operations autograd runs for the reference's
backward, written out by hand: autograd's engine and everything else the harness does in
the server are skipped. Before the evaluator copied results out of the server's memory itself, the same
trick wrote into the output slots and skipped the harness's copies and gradient rule:
1.65-1.79x credited for arithmetic worth 1.03-1.07x. Success: a speed-up the arithmetic does
not have (truth ~1x)."""

import json
import os
import sys

import torch


def _meta(t):
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "ptr": t.data_ptr()}  # fmt: skip


def _serve(sock, get, msg):
    held = []
    while True:
        if msg is None:
            data = sock.recv(1 << 16)
            held.clear()
            if not data:
                os._exit(0)
            msg = json.loads(data)
        if msg.get("op") != "call":
            os._exit(0)
        ins = msg["inputs"]
        x, w = get(ins["x"]["tensor"]), get(ins["weight"]["tensor"])
        eps = ins["eps"]["scalar"]
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        xhat = x * rstd
        y = xhat * w
        held[:] = [y]
        sock.send(json.dumps({"ok": True, "phase": "forward", "outs": [_meta(y)]}).encode())
        nxt = json.loads(sock.recv(1 << 16) or b"null")
        if not isinstance(nxt, dict) or nxt.get("op") != "backward":
            os._exit(0)
        g = get(nxt["grads"][0])
        # autograd's graph of the reference, node by node: y = (x * r) * w, r = rsqrt(m + eps),
        # m = mean(x ** 2)
        ga = g * w
        gwt = (g * xhat).sum(0)
        gx1 = ga * rstd
        gr = (ga * x).sum(-1, keepdim=True)
        gm = gr * (-0.5 * rstd.pow(3))
        gsq = gm.expand_as(x) / x.shape[-1]
        gx = gx1 + gsq * (2 * x)
        held[:] = [y, gx, gwt]
        sock.send(json.dumps({"ok": True, "outs": [_meta(gx), _meta(gwt)]}).encode())
        msg = None


def kernel(x, weight, eps):
    f = sys._getframe(1)
    while f.f_code.co_name != "loop":
        f = f.f_back
    loc = f.f_locals
    bh = loc["backward_half"]
    cells = dict(zip(bh.__code__.co_freevars, (c.cell_contents for c in bh.__closure__)))
    _serve(loc["sock"], cells["get"], loc["msg"])
