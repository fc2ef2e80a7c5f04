"""The OpenAI-compatible server over the inference engine (``mlx-llm serve``): ``protocol`` (the request and
response objects), ``worker`` (the engine on its own thread), ``app`` (FastAPI + uvicorn). Needs the serve extra."""
