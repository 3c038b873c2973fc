"""Math grading: answer extraction, a table of equivalent and non-equivalent answers (fractions,
LaTeX, units, intervals, sets, percentages), and pathological inputs that end in a bounded
time, through math-verify's own timeout and through the hard deadline (worker killed)."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_fr.envs.math_grader import MathGrader, MathGraderConfig, extract_answer

# (response, gold, equivalent)
TABLE = [
    # fractions and decimals
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{0.5}", "\\frac{1}{2}", True),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", True),
    ("\\boxed{2/4}", "\\frac{1}{2}", True),
    ("\\boxed{\\frac{20}{21}}", "20/21", True),
    ("\\boxed{0.333}", "\\frac{1}{3}", False),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", False),
    # LaTeX expressions
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", True),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", True),
    ("\\boxed{9\\pi}", "9\\pi", True),
    ("\\boxed{3.14159}", "\\pi", False),
    ("\\boxed{x^2+2x}", "x^2+2x+1", False),
    # units, degrees, currency, percentages
    ("\\boxed{40 \\text{ cm}^2}", "40", True),
    ("\\boxed{5\\,\\mathrm{cm}}", "5", True),
    ("\\boxed{90^\\circ}", "90", True),
    ("\\boxed{\\$5}", "5", True),
    ("\\boxed{10\\%}", "0.1", True),
    ("\\boxed{41 \\text{ cm}^2}", "40", False),
    # intervals and sets
    ("\\boxed{(-2, 2)}", "(-2,2)", True),
    ("\\boxed{[2, \\infty)}", "[2,\\infty)", True),
    ("\\boxed{[1,2]}", "(1,2)", False),
    ("\\boxed{[0,1)}", "[0,1]", False),
    ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", True),
    ("\\boxed{3, 2}", "2, 3", True),
    # equations and integers
    ("\\boxed{x = 6}", "6", True),
    ("\\boxed{1,000}", "1000", True),
    ("\\boxed{7}", "6", False),
    # extraction without a box
    ("So the final answer is 42.", "42", True),
    ("Answer: \\frac{7}{8}", "0.875", True),
    ("We add them up.\n#### 76127", "76127", True),
    ("Counting gives\n36 apples", "36", True),
    ("The result is 35", "36", False),
]

TOWER = "\\boxed{9^{9^{9^{9^{9}}}}}"
"""Comparing this to a number never ends: only a timeout stops it."""


@pytest.fixture(scope="module")
def grader():
    with MathGrader(MathGraderConfig(workers=2)) as grader:
        yield grader


@pytest.mark.parametrize(("response", "gold", "equivalent"), TABLE)
def test_equivalence_table(grader: MathGrader, response: str, gold: str, equivalent: bool) -> None:
    grade = grader.grade(response, gold)
    assert grade.correct == equivalent, grade
    assert grade.status == ("correct" if equivalent else "incorrect")


def test_extraction_prefers_the_last_box_and_balances_braces() -> None:
    answer = extract_answer("First \\boxed{1}, then \\boxed{\\frac{a}{b^{2}}} is it. 7")
    assert answer is not None and answer.text == "\\frac{a}{b^{2}}" and answer.latex
    stated = extract_answer("Therefore, the answer is $\\frac{1}{2}$.")
    assert stated is not None and stated.text == "\\frac{1}{2}"
    last = extract_answer("Thinking...\n\n  so it is 12  \n")
    assert last is not None and last.text == "so it is 12" and not last.latex
    assert extract_answer("   \n") is None
    assert extract_answer("\\boxed{}") is None


def test_no_answer_and_oversized_answers_are_not_parsed(grader: MathGrader) -> None:
    assert grader.grade("", "1").status == "no_answer"
    huge = grader.grade("\\boxed{" + "1+" * 2000 + "1}", "4001")
    assert huge.status == "incorrect" and huge.elapsed_s < 0.5


def test_pathological_input_times_out_cleanly_in_math_verify() -> None:
    """A power tower: math-verify's own alarm (1 s here) fires inside the worker."""
    config = MathGraderConfig(parse_timeout_s=1, verify_timeout_s=1, deadline_s=20)
    with MathGrader(config) as grader:
        grader.grade("\\boxed{1}", "1")  # the worker is up: time the grade alone
        start = time.monotonic()
        grade = grader.grade(TOWER, "3")
        elapsed = time.monotonic() - start
        assert grade.status == "incorrect" and not grade.correct
        assert elapsed < 5, elapsed
        assert grader.grade("\\boxed{3}", "3").correct  # the same worker still grades


def test_pathological_input_past_the_deadline_kills_the_worker() -> None:
    """With math-verify's alarms at 10 s the power tower runs past the 1 s deadline: the worker
    is killed (by PID), the grade is "timeout", and a fresh worker grades the next answer."""
    config = MathGraderConfig(parse_timeout_s=10, verify_timeout_s=10, deadline_s=1.0)
    with MathGrader(config) as grader:
        grader.grade("\\boxed{1}", "1")
        (worker,) = grader._idle
        start = time.monotonic()
        grade = grader.grade(TOWER, "3")
        elapsed = time.monotonic() - start
        assert grade.status == "timeout" and grade.reward == 0.0
        assert 1.0 <= elapsed < 2.5, elapsed
        assert worker.proc.poll() is not None, "the stuck worker was killed"
        assert grader.grade("\\boxed{\\frac{1}{2}}", "0.5").correct


def test_grades_from_threads_while_other_grades_wait(grader: MathGrader) -> None:
    """math-verify's alarms fail in non-main threads; the workers make that irrelevant."""
    results: dict[int, str] = {}

    def grade(i: int) -> None:
        results[i] = grader.grade(f"\\boxed{{{i}/2}}", str(i / 2)).status

    threads = [threading.Thread(target=grade, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == dict.fromkeys(range(8), "correct")
    assert grader._count <= 2
