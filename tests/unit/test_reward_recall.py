"""Issue #37's recall rules, one module at a time, each beside the wrong answers it must refuse."""

from __future__ import annotations

from fractions import Fraction

import pytest

from services.reward import forms, numeric, prose
from services.reward.exact import compare_structures, to_structure
from services.reward.extract import extract_answer
from services.reward.normalize import normalize


@pytest.mark.parametrize(
    ("pred", "truth", "want"),
    [
        ("1000,99", "1000.99", ("1000.99", "1000.99")),
        ("0,111", "0.111", ("0.111", "0.111")),
        ("1.22", "1,22", ("1.22", "1.22")),
        ("1,222", "1.222", ("1,222", "1.222")),  # thousands-shaped: left alone
        ("1,22", "122", ("1,22", "122")),  # the other side is no decimal: left alone
        ("1,2,3", "1.23", ("1,2,3", "1.23")),  # a list
    ],
)
def test_decimal_comma(pred, truth, want):
    assert numeric.decimal_comma(pred, truth, pred, truth) == want


def test_decimal_comma_never_reads_a_spaced_list():
    assert numeric.decimal_comma("1,22", "1.22", "1, 22", "1.22") == ("1,22", "1.22")


def test_zero_led_comma_group_is_not_thousands():
    assert normalize("0,111") == "0,111" and normalize("1,000") == "1000"


@pytest.mark.parametrize(
    ("decimal", "value", "ok"),
    [
        ("0.0833333333333333", Fraction(1, 12), True),
        ("2.6667", Fraction(8, 3), True),
        ("2.6666", Fraction(8, 3), False),
        ("0.33", Fraction(1, 3), False),
        ("0.3333", Fraction(1, 3), False),  # four significant digits: below the rule
        ("0.33333", Fraction(1, 3), True),
        ("0.1250001", Fraction(1, 8), False),
        ("12", Fraction(12), False),  # not a decimal
    ],
)
def test_rounding_rule(decimal, value, ok):
    assert numeric.rounds_to(decimal, value) is ok


def test_two_decimals_compare_exactly():
    assert not numeric.approximates("2.66667", Fraction("2.66667"), "2.6667", Fraction("2.6667"))
    assert numeric.approximates("2.6667", Fraction("2.6667"), "\\frac{8}{3}", Fraction(8, 3))


def test_irrationals_need_a_doubles_digits():
    assert numeric.places("4.123105625617661", numeric.MIN_SIGNIFICANT_IRRATIONAL) == 15
    assert numeric.places("3.14159", numeric.MIN_SIGNIFICANT_IRRATIONAL) is None


@pytest.mark.parametrize(
    ("line", "value"),
    [
        ("The largest $n$ is 34.", "34"),
        ("the number is not 10 which is 1,000.99€", "1,000.99"),
        ("so the number is 10 which is 1,000.99m²", "1,000.99"),
        ("Jane started growing Sphere 3 hours ago. I hope it is correct.", "3"),
        ("First we get 7. Then the answer is 8.", "8"),
        ("So, the ordered pair $(x, y)$ that solves it is $(7, 6)$.", "(7, 6)"),
        ("It increases by 100%.", "100%"),
        ("It is 12 or 13.", None),  # a hedge
        ("We have 5 apples and 3 pears", None),  # several values, no statement
        ("No value here at all", None),
    ],
)
def test_stated_value(line, value):
    assert prose.is_prose(line) or value is None
    assert prose.stated_value(line) == value


@pytest.mark.parametrize("line", ["x = 3 and y = 4", "12", "$x = 2$ or $x = 3$", "W(x)=1orW(x)=-1"])
def test_not_prose(line):
    assert not prose.is_prose(line)


def test_prose_extraction_does_not_read_the_working():
    working = "We compute 2 + 2 = 4, then 17 and 99. " * 2000
    assert extract_answer("Answer: " + working + "Therefore, the total is 12.") == "12"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("p=5,q=2;p=7,q=2", "(5,2),(7,2)"),
        ("p=5,q=2;q=7,p=2", "p=5,q=2;q=7,p=2"),  # other label order: as written
        ("p=5,q=2;p=7", "p=5,q=2;p=7"),
        ("1\\leq|z|\\leq\\frac{3}{2}", "z\\in[-\\frac{3}{2},-1]\\cup[1,\\frac{3}{2}]"),
        ("1<|z|<2", "z\\in(-2,-1)\\cup(1,2)"),
        ("-1\\leq|z|\\leq2", "-1\\leq|z|\\leq2"),  # a negative lower bound: as written
    ],
)
def test_forms(text, want):
    assert forms.rewrite(text) == want


def test_a_tex_group_list_is_an_ordered_pair():
    group = to_structure(normalize("{1,3}"), tex_group=True)
    assert compare_structures(group, to_structure("(1,3)")) is True
    assert compare_structures(group, to_structure("(3,1)")) is False
    assert compare_structures(to_structure("1,3"), to_structure("(1,3)")) is None  # may be an interval
    a_set = to_structure("\\{1,3\\}")
    assert compare_structures(a_set, to_structure("(1,3)")) is None  # a set: not decided here


def test_boxes_joined_across_a_part_label():
    text = "$$\\boxed{(3, 3)} \\text{ for part (a) and } \\boxed{(1, 1)}$$"
    assert extract_answer(text) == "(3, 3), (1, 1)"
    assert extract_answer("\\boxed{3} \\text{ for the record, not } \\boxed{4}") == "4"
