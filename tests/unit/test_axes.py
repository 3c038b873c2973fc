"""One definition of each x-axis: the run plot's rows and `compare --x` are names of
analysis.axes.X_AXES, and an axis read off each metrics line names the key it is read from."""

from __future__ import annotations

import argparse

import pytest

from megatron_fr.analysis import compare
from megatron_fr.analysis.axes import BUDGETS, PLOT_AXES, X_AXES, logged_key


def test_the_plot_and_the_comparison_name_axes_of_one_table() -> None:
    assert set(PLOT_AXES) <= set(X_AXES) and set(BUDGETS) <= set(X_AXES)
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    x = next(action for action in parser._actions if action.dest == "x")
    assert tuple(x.choices or ()) == BUDGETS


def test_logged_axes_name_their_key_and_computed_ones_refuse() -> None:
    assert [logged_key(axis) for axis in PLOT_AXES] == ["step", "rollouts_total"]
    for computed in ("trained", "tokens"):
        with pytest.raises(ValueError, match=computed):
            logged_key(computed)
