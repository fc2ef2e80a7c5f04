"""The run layer (DESIGN §7), above ``train/`` and below ``eval/`` and ``post/``: the validated settings of every
run kind (``configs``), the run record and its one reader (``record``: ``RunRecord``, ``open_run``), run
directories (``rundir``: the lock, the checks, the resume command), the one parameter loader (``load``), the one
resume rule (``resume``), branches of wsd runs (``branch``), text from a run (``sample``) and the pretraining
driver (``pretrain``). Import the modules themselves; this package's ``__init__`` imports nothing, so the CLI can
read the configs without importing jax.
"""
