"""The run layer (DESIGN §7), below ``train/`` and ``post/``: the validated settings of every run kind
(``configs``), the run record and its one reader (``record``: ``RunRecord``, ``open_run``), the one parameter
loader (``load``: ``load_params`` following the base chain, ``merge_run``, ``write_checkpoint_run``), the one
resume rule (``resume``) and text from a run (``sample``). Import the modules themselves; this package's
``__init__`` imports nothing, so the CLI can read the configs without importing jax.
"""
