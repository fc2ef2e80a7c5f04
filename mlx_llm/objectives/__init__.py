"""Training objectives: the autoregressive cross-entropy and its hand-derived gradients (M20 §10–§11)."""
