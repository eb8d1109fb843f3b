"""Resilience: supervisor, hang detection, snapshots, fault ledger, goodput accounting."""
