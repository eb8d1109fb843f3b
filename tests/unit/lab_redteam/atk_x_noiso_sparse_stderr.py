"""Boundary (isolate=False, which had no RLIMIT_FSIZE): the kernel makes its stderr file (fd 2, in the
job folder) sparse and 1 TiB long with lseek + one write, then exits. Server._died reads
the whole file with Path.read_text() to show its last 12 lines. Success: the evaluator
runs out of memory (a MemoryError escaped evaluate())."""

import os


def kernel(x, weight, eps):
    os.lseek(2, 1 << 40, 0)
    os.write(2, b"x\n")
    os._exit(3)
