"""The ``mlx-llm`` command: train, eval, compile, generate, and the post-training commands (sft, reward, dpo,
rl, …). Flags are generated from the configs (cli/flags.py, cli/parser.py); commands are in cli/commands.py.

Every user error (an ``MLXLLMError``, a bad flag, an unreadable file) prints one line naming the problem and
the fix on stderr and exits with status 2, without a traceback; nothing already written is overwritten. A
training run stopped by SIGTERM / SIGINT checkpoints at the next step boundary and exits 0; a checkpoint that
cannot be written, or any write meets a full disk, exits 1; Ctrl-C outside a training loop exits 130.
Importing this package imports no jax (``mlx-llm --help`` answers at once).
"""

from __future__ import annotations

import errno
import signal
import sys

from mlx_llm.cli.commands import COMMANDS, TRAINING, sigterm_interrupts, trust_of
from mlx_llm.cli.flags import apply_sets, given
from mlx_llm.cli.parser import build_parser
from mlx_llm.errors import CheckpointWriteError, MLXLLMError

__all__ = ["build_parser", "main"]


def os_error_line(exc: OSError, command: str) -> str:
    """An ``OSError`` as one line: what failed, on which file when it names one; a full disk says how to go on."""
    where = f" ({exc.filename})" if exc.filename else ""
    line = f"{exc.strerror or exc}{where}"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        kept = "; the last checkpoint is kept (continue with --resume)" if command in TRAINING else ""
        target = str(exc.filename) if exc.filename else "a file"
        line = f"no space left on device writing {target}: free some space{kept}"
    return line


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        fields = given(args)
        if hasattr(args, "sections"):
            fields = apply_sets(fields, args.sets, args.sections)
        with sigterm_interrupts(), trust_of(args):
            return COMMANDS[args.command](args, fields, args.subparser)
    except CheckpointWriteError as exc:  # a write failed (a full disk): status 1, as documented
        print(f"mlx-llm {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except MLXLLMError as exc:
        print(f"mlx-llm {args.command}: error: {exc}", file=sys.stderr)
    except OSError as exc:
        print(f"mlx-llm {args.command}: error: {os_error_line(exc, args.command)}", file=sys.stderr)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # a write failed: status 1, as for a checkpoint
            return 1
    except KeyboardInterrupt:
        kept = "; the last checkpoint is kept (continue with --resume)" if args.command in TRAINING else ""
        print(f"mlx-llm {args.command}: interrupted{kept}", file=sys.stderr)
        return 130
    return 2


def run() -> None:
    """The ``mlx-llm`` process: ``main``, then exit with its status. Once the command has finished, a late SIGINT
    or SIGTERM is ignored: the process is only exiting (jax's and the libraries' exit handlers run), and a signal
    there would print a traceback instead of ending quietly."""
    code = main()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    run()
