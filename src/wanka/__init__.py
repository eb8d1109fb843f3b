"""wanka: MoE + sparse-attention training from a laptop CPU to 10k accelerators."""

__version__ = "0.1.0"
