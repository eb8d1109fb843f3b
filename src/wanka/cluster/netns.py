"""Thin wrappers over iproute2: namespaces, the bridge, veth pairs and tc shaping. Every failure
becomes one line naming the command and what to do about it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time


class ClusterError(ValueError):
    """A testbed command failed; the message is one line (the CLI prints it as is)."""


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as e:
        raise ClusterError(
            f"`{cmd[0]}` not found: install iproute2 (apt-get install iproute2)"
        ) from e
    if check and p.returncode != 0:
        err = (p.stderr or p.stdout).strip().splitlines()
        why = err[-1] if err else f"exit {p.returncode}"
        raise ClusterError(f"`{' '.join(cmd)}` failed: {why} (needs root and iproute2)")
    return p


def missing_requirements() -> str | None:
    """Why the testbed cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: apt-get install iproute2"
    probe = f"wanka-probe-{os.getpid()}"
    p = sh("ip", "netns", "add", probe, check=False)
    if p.returncode != 0:
        return f"cannot create a network namespace: {p.stderr.strip()}"
    sh("ip", "netns", "del", probe, check=False)
    return None


def netns_list() -> set[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def link_exists(name: str, netns: str | None = None) -> bool:
    ns = ["-n", netns] if netns else []
    return sh("ip", *ns, "link", "show", "dev", name, check=False).returncode == 0


def links(netns: str | None = None) -> list[dict]:
    ns = ["-n", netns] if netns else []
    return json.loads(sh("ip", *ns, "-j", "link", "show").stdout or "[]")


def addrs(netns: str | None = None) -> list[str]:
    """All IPv4 addresses with prefix ("10.231.0.1/24") in a namespace (default: the root)."""
    ns = ["-n", netns] if netns else []
    out = json.loads(sh("ip", *ns, "-j", "-4", "addr", "show").stdout or "[]")
    return [f"{a['local']}/{a['prefixlen']}" for i in out for a in i.get("addr_info", [])]


def routes(netns: str | None = None) -> list[str]:
    ns = ["-n", netns] if netns else []
    return [r["dst"] for r in json.loads(sh("ip", *ns, "-j", "-4", "route").stdout or "[]")]


def netns_pids(netns: str) -> list[int]:
    p = sh("ip", "netns", "pids", netns, check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def kill_netns_pids(netns: str, timeout: float = 5.0) -> int:
    """SIGKILL every process living in the namespace (a node losing power); returns how many."""
    killed = 0
    deadline = time.monotonic() + timeout
    while pids := [p for p in netns_pids(netns) if p != os.getpid()]:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise ClusterError(
                f"processes {pids} in {netns} survive SIGKILL; check `ps` for D state"
            )
        time.sleep(0.05)  # children forked in between are caught on the next pass
    return killed


def shape(dev: str, gbit: float, netns: str | None = None) -> None:
    """Token-bucket egress shaping to `gbit`. Burst = 1 ms of traffic (at least 128 KiB, since
    veth and lo pass 64 KiB GSO packets): measured here to reach ~95% of the rate at 1 Gbit/s."""
    rate_bytes = gbit * 1e9 / 8
    burst = max(128 * 1024, int(rate_bytes / 1000))
    ns = ["-n", netns] if netns else []
    rate = f"{gbit * 1000:g}mbit"
    sh("tc", *ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst),
       "latency", "50ms")  # fmt: skip


def qdisc(dev: str, netns: str | None = None) -> str:
    ns = ["-n", netns] if netns else []
    """The shaping on a device, e.g. "tbf rate 1Gbit burst 131000b" ("" when none)."""
    out = sh("tc", *ns, "qdisc", "show", "dev", dev, check=False).stdout.split()
    if "tbf" not in out:
        return ""
    return " ".join(["tbf", *out[out.index("rate") : out.index("rate") + 4]])


def wait_gone(names: list[str], timeout: float = 5.0) -> None:
    """Kernel teardown of veths in a deleted namespace is asynchronous; wait so that the next
    `up` does not trip over a half-gone interface with the same name."""
    deadline = time.monotonic() + timeout
    while any(link_exists(n) for n in names) and time.monotonic() < deadline:
        time.sleep(0.05)
