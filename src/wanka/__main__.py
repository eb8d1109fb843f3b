"""`python -m wanka ...`: the same CLI as the `wanka` script (benchmarks run it this way)."""

from wanka.cli import entry

entry()
