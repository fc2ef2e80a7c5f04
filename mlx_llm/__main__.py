import sys

from mlx_llm.cli import main

sys.exit(main())
