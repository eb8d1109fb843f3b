"""Proposers: where candidates come from. `search` (offline) and `llm` (any
OpenAI-compatible chat endpoint); add one by subclassing `Proposer`."""

from wanka.lab.proposers.base import Proposal, Proposer

__all__ = ["Proposal", "Proposer"]
