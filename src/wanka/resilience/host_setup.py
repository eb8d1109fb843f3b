"""Where the control store of a multi-host job lives and who serves it (resilience/
host_control.py), and what a host keeps to itself: its heartbeat folder, its own children."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger("wanka.supervisor")
CONTROL_PORT_ENV = "WANKA_CONTROL_PORT"
CONTROL_ENDPOINT_ENV = "WANKA_CONTROL_ENDPOINT"


def is_coordinator(control_host: str) -> bool:
    """This host coordinates: the host WANKA_CONTROL_ENDPOINT names, else Slurm's node 0, else
    the host the rendezvous endpoint names (torch's own rule for who hosts the c10d store)."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    node_id = os.environ.get("SLURM_NODEID")
    if node_id is not None and CONTROL_ENDPOINT_ENV not in os.environ:
        first = node_id.strip() == "0"
        if first and not _matches_machine_hostname(control_host):  # a hand-written script?
            log.warning("SLURM_NODEID 0 coordinates, but the rendezvous endpoint names %s, "
                        "not this host: the others will look for the control store there; "
                        "point --rdzv-endpoint at the allocation's first node", control_host)  # fmt: skip
        return first
    return _matches_machine_hostname(control_host)


def control_address(rdzv: dict) -> tuple[str, int]:
    """(host, port) of the control store: WANKA_CONTROL_ENDPOINT if set, else the c10d
    rendezvous host and its port + 1 (WANKA_CONTROL_PORT to change the port). An etcd
    rendezvous names the etcd server, not one of the job's hosts: there the address is needed."""
    given = os.environ.get(CONTROL_ENDPOINT_ENV)
    backend = str(rdzv.get("rdzv_backend") or "c10d")
    if given is None and backend.startswith("etcd"):
        raise ValueError(f"resilience.control = store with --rdzv-backend {backend}: the "
                         "control store is a TCPStore served by one of the job's hosts, and an "
                         "etcd endpoint is not one; set WANKA_CONTROL_ENDPOINT=HOST:PORT (that "
                         "host coordinates), or use the c10d rendezvous")  # fmt: skip
    flag = CONTROL_ENDPOINT_ENV if given is not None else "--rdzv-endpoint"
    endpoint = given if given is not None else str(rdzv.get("rdzv_endpoint") or "")
    host, _, port = endpoint.rpartition(":")
    if not host or not _is_port(port):
        raise ValueError(f"resilience.control = store across hosts needs {flag} HOST:PORT, "
                         f"the port 1-65535 (got {endpoint!r})")  # fmt: skip
    if given is not None:
        return host.strip("[]"), int(port)
    own = os.environ.get(CONTROL_PORT_ENV)
    if own is not None and not _is_port(own):
        raise ValueError(f"{CONTROL_PORT_ENV}={own!r}: a port number 1-65535, e.g. 29501")
    if not own and int(port) + 1 > 65535:
        raise ValueError(f"{flag} {endpoint!r}: the control store takes the rendezvous port + 1, "
                         f"and {int(port) + 1} is no port: use a rendezvous port of 1-65534, or "
                         f"set {CONTROL_PORT_ENV} (1-65535)")  # fmt: skip
    return host.strip("[]"), int(own) if own else int(port) + 1


def _is_port(text: str) -> bool:
    """1-65535 in ASCII digits ('²'.isdigit() is true, but int() refuses it)."""
    return text.isascii() and text.isdigit() and 0 < int(text) < 65536


def local_hb_root() -> Path:
    """Host-local folder for the ranks' heartbeat files: memory, not the shared run dir."""
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / "wanka-control"


def children() -> dict[int, bytes]:
    """pid -> command line of every child of this process."""
    me, out = os.getpid(), {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            if int(text[text.rindex(")") + 2 :].split()[1]) == me:
                out[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError):
            pass
    return out


def safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name) or "job"
