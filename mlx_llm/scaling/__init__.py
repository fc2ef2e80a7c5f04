"""Accounting (parameters, FLOPs, cache bytes) and scaling laws (U19 §3, §6, §8; M20 §8, §14)."""
