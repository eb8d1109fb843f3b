"""Bytes on the inter-node links, read from the kernel's interface counters.

Each node's only way out is its veth; the bridge side of it (in the root namespace, so no
namespace needs entering) receives exactly what the node sends. Bytes a node sent over the
link = rx_bytes of its host-side veth (Ethernet frames: payload plus TCP/IP/Ethernet headers,
ACKs included). Traffic between ranks of one node goes over the node's loopback and never
shows here.
"""

from __future__ import annotations

import bisect
import threading
import time
from pathlib import Path

SYS_NET = Path("/sys/class/net")


def read_sent(host_ifs: dict[str, str], root: Path = SYS_NET) -> dict[str, int]:
    """{node: bytes it has sent over its link so far} from {node: host-side veth name}."""
    return {
        node: int((root / dev / "statistics" / "rx_bytes").read_text())
        for node, dev in host_ifs.items()
    }


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


class CounterSampler:
    """Samples the summed counters every `interval` s in a thread: (wall time, bytes) pairs,
    so bytes between two moments of a run (e.g. two steps' metrics rows) can be read back."""

    def __init__(self, host_ifs: dict[str, str], interval: float = 0.05, root: Path = SYS_NET):
        self.host_ifs, self.interval, self.root = host_ifs, interval, root
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _take(self) -> None:
        self.samples.append((time.time(), sum(read_sent(self.host_ifs, self.root).values())))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def __enter__(self) -> CounterSampler:
        self._take()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._take()


def bytes_at(samples: list[tuple[float, int]], t: float) -> float:
    """Counter value at time t, linearly interpolated between the samples around it."""
    times = [s[0] for s in samples]
    i = bisect.bisect_left(times, t)
    if i == 0:
        return float(samples[0][1])
    if i == len(samples):
        return float(samples[-1][1])
    (t0, b0), (t1, b1) = samples[i - 1], samples[i]
    return b0 + (b1 - b0) * (t - t0) / (t1 - t0) if t1 > t0 else float(b1)


def window_per_step(samples: list[tuple[float, int]], step_times: dict[int, float],
                    first: int, last: int) -> float | None:  # fmt: skip
    """Bytes per step between the metrics rows of steps `first` and `last` (wall times at which
    rank 0 logged them): a within-run estimate to cross-check the two-run difference. Its
    edges are fuzzy by the ranks' skew within a step, which the window's length dilutes."""
    if first not in step_times or last not in step_times or last <= first or len(samples) < 2:
        return None
    b = bytes_at(samples, step_times[last]) - bytes_at(samples, step_times[first])
    return b / (last - first)
