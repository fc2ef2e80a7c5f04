"""The ``mlx-llm`` command: train, eval, compile, generate, and the post-training commands (sft, reward, dpo,
rl, …). Flags are generated from the configs (cli/flags.py, cli/parser.py); commands are in cli/commands.py.

Every user error (an ``MLXLLMError``, a bad flag, an unreadable file) prints one line naming the problem and
the fix on stderr and exits with status 2, without a traceback; nothing already written is overwritten. A
training run stopped by SIGTERM / SIGINT checkpoints at the next step boundary and exits 0; a checkpoint that
cannot be written (a full disk) exits 1; Ctrl-C outside a training loop exits 130.
Importing this package imports no jax (``mlx-llm --help`` answers at once).
"""

from __future__ import annotations

import sys

from mlx_llm.cli.commands import COMMANDS, TRAINING, trust_of
from mlx_llm.cli.flags import apply_sets, given
from mlx_llm.cli.parser import build_parser
from mlx_llm.errors import MLXLLMError

__all__ = ["build_parser", "main"]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        fields = given(args)
        if hasattr(args, "sections"):
            fields = apply_sets(fields, args.sets, args.sections)
        with trust_of(args):
            return COMMANDS[args.command](args, fields, args.subparser)
    except MLXLLMError as exc:
        print(f"mlx-llm {args.command}: error: {exc}", file=sys.stderr)
    except OSError as exc:
        print(f"mlx-llm {args.command}: error: {exc.strerror or exc} ({exc.filename or ''})", file=sys.stderr)
    except KeyboardInterrupt:
        kept = "; the last checkpoint is kept (continue with --resume)" if args.command in TRAINING else ""
        print(f"mlx-llm {args.command}: interrupted{kept}", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
