"""The methods a notebook prints are chosen by what they say, from the installed code."""

from __future__ import annotations

import pytest

from minipaged.sched.mlfq import SkipJoinMLFQScheduler
from teaching.source import methods_mentioning


class Example:
    def first(self) -> int:
        """Mentions the quantum."""
        return 1

    def second(self) -> int:
        return 2

    def third(self) -> str:
        return "quantum"


def test_only_the_methods_that_mention_the_word_in_class_order():
    shown = methods_mentioning(Example, "quantum")
    assert shown.startswith("def first(self)") and "def third(self)" in shown
    assert "def second" not in shown
    assert methods_mentioning(Example, "nowhere") == ""


def test_the_mlfq_rules_notebook_07_prints():
    shown = methods_mentioning(SkipJoinMLFQScheduler, "quantum")
    assert "skip_join" in shown and "demot" in shown


def test_a_function_is_not_a_class():
    with pytest.raises(TypeError):
        methods_mentioning(methods_mentioning, "x")
