"""Boundary (the two-half call): the kernel walks its frames to the serving loop, answers the
forward half itself with an EMPTY output list before computing anything, reads the gradient
seed, and computes the forward fused with the backward straight into the output slots,
serving every later call itself. Success: a speed-up the exported kernel does not have (it
was credited 2.0-2.3x while the check skipped an empty forward)."""

import json
import os
import sys

import torch


def _align(n):
    return (n + 63) // 64 * 64


def _meta(t, off):
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": off}


def _serve(sock, buf, first):
    msg = first
    while True:
        if msg is None:
            data = sock.recv(1 << 16)
            if not data:
                os._exit(0)
            msg = json.loads(data)
        if msg.get("op") != "call":
            os._exit(0)
        # forward half first, nothing computed, nothing described
        sock.send(json.dumps({"ok": True, "phase": "forward", "outs": []}).encode())
        nxt = json.loads(sock.recv(1 << 16) or b"null")
        if not isinstance(nxt, dict) or nxt.get("op") != "backward":
            os._exit(0)
        ins = msg["inputs"]
        xm, wm = ins["x"]["tensor"], ins["weight"]["tensor"]
        eps = ins["eps"]["scalar"]
        x, w = buf.get(xm), buf.get(wm)
        P = xm["offset"] // 4
        N, D = x.shape
        n = N * D
        start = nxt["seed"] % (P - n + 1)
        g = buf.bytes[start * 4 : start * 4 + 4 * n].view(torch.float32).view(N, D)
        a = _align(msg["out_at"])
        b = _align(a + 4 * n)
        c = _align(b + 4 * n)
        y = buf.view(a, torch.float32, [N, D])
        gx = buf.view(b, torch.float32, [N, D])
        gwo = buf.view(c, torch.float32, [D])
        # fused: forward and backward computed together, with the seed already known
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        xhat = x * rstd
        torch.mul(xhat, w, out=y)
        gw = g * w
        s = (gw * xhat).mean(-1, keepdim=True)
        torch.mul(xhat, s, out=gx)
        torch.sub(gw, gx, out=gx)
        gx.mul_(rstd)
        torch.sum(g * xhat, 0, out=gwo)
        sock.send(
            json.dumps({"ok": True, "outs": [_meta(y, a), _meta(gx, b), _meta(gwo, c)]}).encode()
        )
        msg = None


def kernel(x, weight, eps):
    f = sys._getframe(1)
    while f.f_code.co_name != "loop":
        f = f.f_back
    L = f.f_locals
    bh = L["backward_half"]
    cells = dict(zip(bh.__code__.co_freevars, (c.cell_contents for c in bh.__closure__)))
    _serve(L["sock"], cells["put"].__self__, L["msg"])
