"""Command lines whose dotted.key=value overrides may come after the options: argparse's
positional matching takes a trailing positional only before the options
(`train RECIPE --run-dir DIR steps=2` would leave `steps=2` unmatched), so the overrides it
could not place come back as unknown arguments and are appended here."""

from __future__ import annotations

import argparse


def parse_with_trailing_overrides(
    parser: argparse.ArgumentParser, argv: list[str]
) -> argparse.Namespace:
    """`argv` parsed, with any key=value argparse left over appended to `overrides`; anything
    else left over (or any leftover for a command without overrides) is argparse's error."""
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "overrides", None) is None:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    unknown = [item for item in extra if "=" not in item or item.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args
