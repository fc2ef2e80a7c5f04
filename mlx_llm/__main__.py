from mlx_llm.cli import run

run()
