"""One module per sublayer kind: attention (GQA mixer), ffn (SwiGLU)."""
