"""`megatron-fr config show RECIPE [KEY] [key=value ...]` and `megatron-fr config reference`.

show       the recipe's resolved settings (after the overrides), each with its default where
           it differs and its doc; KEY narrows to one setting or section (learner.flash_reinforce)
reference  the generated reference of every setting (docs/config.md), to stdout or --out
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megatron_fr.config.reference import render_reference, show
from megatron_fr.config.run import load_run_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    shown = actions.add_parser("show", help="a recipe's resolved settings with their docs")
    shown.add_argument("recipe", type=Path)
    shown.add_argument("key", nargs="?", help="one setting or section, dotted")
    shown.add_argument("overrides", nargs="*", help="key=value, as for train")
    reference = actions.add_parser("reference", help="every setting's doc (docs/config.md)")
    reference.add_argument("--out", type=Path, help="write here instead of stdout")


def main(args: argparse.Namespace) -> int:
    if args.action == "reference":
        text = render_reference()
        if args.out is None:
            sys.stdout.write(text)
            return 0
        try:
            _write_reference(args.out, text)
        except (OSError, ValueError) as error:  # a directory, under a file, a NUL: one line
            reason = getattr(error, "strerror", None) or str(error)
            print(f"megatron-fr config: error: --out {args.out}: {reason}", file=sys.stderr)
            return 2
        return 0
    key, overrides = args.key, list(args.overrides)
    if key is not None and "=" in key:  # no KEY given: the first override took its place
        key, overrides = None, [key, *overrides]
    try:
        config = load_run_config(args.recipe, overrides)
        print(show(config, key))
    except (ValueError, OSError) as error:  # a bad recipe, key or file: one line
        print(f"megatron-fr config: error: {error}", file=sys.stderr)
        return 2
    return 0


def _write_reference(out: Path, text: str) -> None:
    """Write the reference to `out`, a file whose folder exists; anything else is an OSError
    naming why (a directory there would otherwise be an IsADirectoryError traceback, and a
    FIFO would block until a reader came)."""
    if out.is_dir():
        raise IsADirectoryError(21, "a directory (give a file path, e.g. docs/config.md)")
    if os.path.lexists(out) and not out.is_file():
        raise OSError(17, "exists and is not a regular file")
    if not out.parent.is_dir():
        raise NotADirectoryError(20, f"its folder {out.parent} is missing or not a directory")
    out.write_text(text)
