"""FlashSpec: exact, adaptive speculative decoding (fused verification, bandit drafter
selection, low-rank drafter heads). Subpackages: models, drafters, heads, verify, bandits."""

__version__ = "0.1.0"
