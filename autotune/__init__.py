"""autotune: find the memory/throughput configuration for training on multi-million-token sequences."""

__version__ = "0.1.0"
