"""One exception family for the whole library (DESIGN §4).

Every error names what was wrong, the value seen and what would be valid. The CLI turns an
``MLXLLMError`` into a one-line message and exit code 2; anything else is a bug.
"""


class MLXLLMError(Exception):
    """Base class of every error mlx_llm raises on purpose."""


class ConfigError(MLXLLMError, ValueError):
    """An invalid configuration field (model, training, sampling)."""


class InputError(MLXLLMError, ValueError):
    """Invalid input data: token ids out of range, bad shapes, empty loss masks."""


class DataError(MLXLLMError):
    """A corpus, file or directory that cannot be used."""


class CheckpointError(MLXLLMError):
    """A run directory or checkpoint that cannot be read, resumed or written."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint or a new directory could not be written (a full disk, a failed write): nothing half-written
    is left, earlier checkpoints are intact. The CLI exits with status 1."""


class ResumeMismatch(ConfigError, CheckpointError):
    """A resume asked with settings that differ from the run's: a configuration error about a run directory (the
    one resume rule, runs/resume.py)."""
