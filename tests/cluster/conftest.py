# The cluster testbed's fixture (skips with the reason where root/iproute2/netns are missing).
from wanka.cluster.fixtures import wanka_cluster  # noqa: F401
