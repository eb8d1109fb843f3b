"""Cluster-in-a-box: turn this machine into N "nodes" (network namespaces on a private, shaped
bridge network) to test multi-node behaviour for real. Needs root and iproute2 (`ip`, `tc`)."""

from wanka.cluster.launch import launch_on_cluster, run_on_cluster
from wanka.cluster.netns import ClusterError, missing_requirements
from wanka.cluster.nodes import kill_node, node_env, popen, remove_node, run, set_link, start_node
from wanka.cluster.state import ClusterState, Node, load, require
from wanka.cluster.testbed import down, status, up

__all__ = ["ClusterError", "ClusterState", "Node", "down", "kill_node", "launch_on_cluster",
           "load", "missing_requirements", "node_env", "popen", "remove_node", "require", "run",
           "run_on_cluster", "set_link", "start_node", "status", "up"]  # fmt: skip
