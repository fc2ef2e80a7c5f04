"""Decoding: the decode state (KV cache, SSM state), sampling rules and the jitted generation loop."""
