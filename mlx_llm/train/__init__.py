"""The training machinery, below the run layer: optimizer (``optim``, ``masks``, ``muon``), the compiled step
(``step``), parallelism (``parallel``), orbax checkpoints with checksum manifests (``checkpoint``), the one loop of
every run kind (``loop``), the language-model job (``lm``), metrics, per-layer watch, trackers and the pre-flight
compiler. Nothing here reads ``run.json`` or knows a command's name: what it needs of a run is passed in."""
