"""Dependency messages kept off the console (utils/quiet.py): the known ones, matched by their
exact text, go to RUN_DIR/logs/dependencies.log; a message that differs by a word, another
category or another logger still reaches the console. Run in a process of its own: the hooks
are process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from megatron_fr.utils.quiet import KNOWN_LOG_RECORDS, KNOWN_WARNINGS, LOG_NAME

SCRIPT = textwrap.dedent(
    """
    import logging, sys, warnings
    from megatron_fr.utils.quiet import KNOWN_LOG_RECORDS, KNOWN_WARNINGS, quiet_known_messages
    warnings.simplefilter("always")
    quiet_known_messages(sys.argv[1])
    quiet_known_messages(sys.argv[1])  # twice: one line per message still
    for category, text in KNOWN_WARNINGS:
        warnings.warn(text, category)
    warnings.warn(KNOWN_WARNINGS[0][1] + " (changed)", UserWarning)
    warnings.warn(KNOWN_WARNINGS[0][1], DeprecationWarning)
    for name, text in KNOWN_LOG_RECORDS:
        logging.getLogger(name).warning(text)
    logging.getLogger(KNOWN_LOG_RECORDS[0][0]).warning("a new message of that logger")
    logging.getLogger("another.library").warning(KNOWN_LOG_RECORDS[0][1])
    """
)


def test_known_messages_go_to_the_log_and_the_rest_to_the_console(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, check=True
    )
    console = result.stderr
    log = (tmp_path / LOG_NAME).read_text().splitlines()
    assert len(log) == len(KNOWN_WARNINGS) + len(KNOWN_LOG_RECORDS)
    for (_, text), line in zip([*KNOWN_WARNINGS, *KNOWN_LOG_RECORDS], log, strict=True):
        assert line.endswith(f": {text}")
    first_warning, first_record = KNOWN_WARNINGS[0][1], KNOWN_LOG_RECORDS[0][1]
    assert f"UserWarning: {first_warning} (changed)" in console
    assert f"DeprecationWarning: {first_warning}" in console
    assert "a new message of that logger" in console
    assert console.count(first_record) == 1  # from another.library only
    for _, text in KNOWN_WARNINGS[1:]:
        assert text not in console


def test_a_log_that_cannot_be_written_leaves_the_messages_on_the_console(tmp_path: Path) -> None:
    """A run directory that is a symlink loop: the known messages reach the console, as if
    nothing were installed, and no logging call raises (a filter that raised broke megatron's
    model constructor in whichever later code logged)."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(loop)], capture_output=True, text=True, check=True
    )
    for _, text in [*KNOWN_WARNINGS, *KNOWN_LOG_RECORDS]:
        assert text in result.stderr
