"""Boundary (the evaluator's parser): at import, a reply nested 30000 deep is written on the
server's socket (fd 3), where json.loads raises RecursionError, not ValueError. Success: the
evaluation crashes instead of rejecting the candidate (or credits it)."""

import posix

posix.write(3, b"[" * 30000 + b"]" * 30000)


def kernel(x, weight, eps):
    return x
