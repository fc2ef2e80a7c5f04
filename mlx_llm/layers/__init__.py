"""One module per sublayer kind: attention (GQA mixer), ffn (SwiGLU), moe (routed experts), mamba (selective SSM)."""
