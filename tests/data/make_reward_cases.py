"""Writes tests/data/reward_cases.jsonl: hand-labelled grading cases, one category per block.

Every label below was decided by a person reading the pair, never by running a grader.
Each tuple is (response, ground_truth, correct). Run: ``python tests/data/make_reward_cases.py``.
"""

from __future__ import annotations

import json
from pathlib import Path


def A(x: str) -> str:  # DAPO's answer line
    return f"Let me work it out step by step.\nAnswer: {x}"


def B(x: str) -> str:  # boxed
    return f"After simplifying we get $\\boxed{{{x}}}$."


def T(x: str) -> str:  # ReTool answer tag
    return f"The computation confirms it.\n<answer>\n\\boxed{{{x}}}\n</answer>"


CASES: dict[str, list[tuple[str, str, bool]]] = {
    "integer": [
        (A("34"), "34", True),
        (A("$113$"), "113", True),
        (A("-3"), "-3", True),
        (B("204"), "204", True),
        (T("25"), "25", True),
        (A("034"), "34", True),
        (A("+7"), "7", True),
        (B("0"), "0", True),
        (A("35"), "34", False),
        (A("3"), "-3", False),
        (B("1130"), "113", False),
        (A("100"), "1", False),
        (T("24"), "25", False),
        (A("-34"), "34", False),
        (B("2040"), "204", False),
        (A("1"), "100", False),
    ],
    "rational": [
        (B("\\frac{1}{2}"), "\\frac{1}{2}", True),
        (B("1/2"), "\\frac{1}{2}", True),
        (B("0.5"), "\\frac{1}{2}", True),
        (B("\\dfrac{3}{4}"), "\\frac{3}{4}", True),
        (B("\\tfrac{3}{4}"), "0.75", True),
        (B("\\frac{6}{8}"), "\\frac34", True),
        (B("-\\frac{2}{3}"), "-\\frac{2}{3}", True),
        (B("\\frac{-2}{3}"), "-2/3", True),
        (A("$\\frac{7}{2}$"), "3.5", True),
        (B("\\frac{10}{5}"), "2", True),
        (B("0.333"), "\\frac{1}{3}", False),
        (B("\\frac{2}{3}"), "\\frac{3}{2}", False),
        (B("0.67"), "\\frac{2}{3}", False),
        (B("\\frac{1}{2}"), "-\\frac{1}{2}", False),
        (B("3/4"), "4/3", False),
        (B("0.5"), "5", False),
        (B("\\frac{1}{20}"), "\\frac{1}{2}", False),
    ],
    "decimal": [
        (A("2.5"), "2.5", True),
        (A("2.50"), "2.5", True),
        (B(".75"), "0.75", True),
        (A("3.0"), "3", True),
        (B("0.125"), "\\frac{1}{8}", True),
        (A("-0.2"), "-\\frac{1}{5}", True),
        (A("2.49"), "2.5", False),
        (A("0.75"), "0.57", False),
        (B("0.13"), "\\frac{1}{8}", False),
        (A("25"), "2.5", False),
        (A("0.025"), "2.5", False),
    ],
    "radical": [
        (B("2\\sqrt{3}"), "2\\sqrt{3}", True),
        (B("\\sqrt{12}"), "2\\sqrt{3}", True),
        (B("\\frac{\\sqrt{3}}{2}"), "\\frac{1}{2}\\sqrt{3}", True),
        (B("\\sqrt{8}"), "2\\sqrt{2}", True),
        (B("3\\sqrt{2}"), "\\sqrt{18}", True),
        (B("\\frac{1}{\\sqrt{2}}"), "\\frac{\\sqrt{2}}{2}", True),
        (B("1+\\sqrt{5}"), "\\sqrt{5}+1", True),
        (B("\\frac{\\sqrt2}{2}"), "\\frac{\\sqrt{2}}{2}", True),
        (B("2 \\sqrt 3"), "2\\sqrt{3}", True),
        (B("3\\sqrt{2}"), "2\\sqrt{3}", False),
        (B("\\sqrt{3}"), "3", False),
        (B("1.732"), "\\sqrt{3}", False),
        (B("1.414"), "\\sqrt{2}", False),
        (B("\\sqrt{13}"), "2\\sqrt{3}", False),
        (B("1-\\sqrt{5}"), "1+\\sqrt{5}", False),
    ],
    "pi": [
        (B("2\\pi"), "2\\pi", True),
        (B("\\pi \\cdot 2"), "2\\pi", True),
        (B("\\frac{3\\pi}{2}"), "\\frac{3}{2}\\pi", True),
        (B("3\\pi/2"), "\\frac{3\\pi}{2}", True),
        (B("\\frac{\\pi}{4}"), "\\pi/4", True),
        (B("4\\pi^2"), "(2\\pi)^2", True),
        (B("6.28"), "2\\pi", False),
        (B("3.14"), "\\pi", False),
        (B("3.14159"), "\\pi", False),
        (B("\\pi"), "2\\pi", False),
        (B("\\frac{\\pi}{3}"), "\\frac{\\pi}{6}", False),
        (B("2\\pi"), "\\pi^2", False),
    ],
    "scientific": [
        (A("1.5e3"), "1500", True),
        (A("1.5\\times10^{3}"), "1500", True),
        (A("2 \\times 10^{-3}"), "0.002", True),
        (A("3\\times10^4"), "30000", True),
        (A("1e6"), "1000000", True),
        (A("1.5\\times10^{4}"), "1500", False),
        (A("2e-3"), "0.02", False),
        (A("1e5"), "1000000", False),
    ],
    "thousands_units": [
        (A("1,000"), "1000", True),
        (A("12\\,345"), "12345", True),
        (A("1{,}000"), "1000", True),
        (A("\\$5"), "5", True),
        (A("5 dollars"), "5", True),
        (B("12\\text{ cm}"), "12", True),
        (A("30^\\circ"), "30", True),
        (A("45 degrees"), "45", True),
        (B("90^{\\circ}"), "90", True),
        (A("50\\%"), "50", True),
        (A("7 units"), "7", True),
        (A("1,234,567"), "1234567", True),
        (A("12 cm"), "13", False),
        (A("\\$50"), "5", False),
        (A("30^\\circ"), "60", False),
        (A("1,001"), "1000", False),
        (A("5\\%"), "50", False),
    ],
    "latex_noise": [
        (B("\\left(\\frac{1}{2}\\right)"), "\\frac{1}{2}", True),
        (B("\\frac{1}{2}\\!"), "\\frac12", True),
        (B("\\text{5}"), "5", True),
        (B("\\textbf{17}"), "17", True),
        (B("\\mathbf{17}"), "17", True),
        (A("x = 5"), "5", True),
        (A("$k=12$"), "12", True),
        (A("18."), "18", True),
        (B("\\displaystyle 9"), "9", True),
        (B("\\mathrm{42}"), "42", True),
        (B("\\pi r^2"), "\\pi r^{2}", True),
        (B("2 \\cdot x"), "2x", True),
        (A("x = 6"), "5", False),
        (B("\\text{15}"), "17", False),
        (A("19."), "18", False),
    ],
    "text": [
        (B("\\text{Monday}"), "Monday", True),
        (A("monday"), "\\text{Monday}", True),
        (A("(B)"), "B", True),
        (A("B"), "\\text{(B)}", True),
        (A("Yes"), "yes", True),
        (B("\\text{even}"), "even", True),
        (A("Tuesday"), "Monday", False),
        (A("(C)"), "B", False),
        (A("No"), "yes", False),
        (A("odd"), "even", False),
    ],
    "interval": [
        (B("[1, 2)"), "[1,2)", True),
        (B("(-\\infty, 3]"), "(-\\infty,3]", True),
        (B("\\left[0, \\frac{1}{2}\\right]"), "[0, 0.5]", True),
        (B("(0, \\infty)"), "(0,\\infty)", True),
        (B("x \\in [1, 2]"), "[1,2]", True),
        (B("x \\in (1, 2]"), "[1,2]", False),
        (B("[1, 2]"), "[1,2)", False),
        (B("(1, 2)"), "[1,2]", False),
        (B("(-\\infty, 3)"), "(-\\infty,3]", False),
        (B("[0, 1]"), "[0, 2]", False),
    ],
    "set_tuple": [
        (B("\\{1, 2\\}"), "\\{2,1\\}", True),
        (A("1, 2, 3"), "3, 2, 1", True),
        (A("-1, 4"), "4,-1", True),
        (B("\\{\\frac{1}{2}, 3\\}"), "\\{3, 0.5\\}", True),
        (B("(3, 4)"), "(3,4)", True),
        (B("(1, 2, 3)"), "(1,2,3)", True),
        (A("2, -2"), "-2, 2", True),
        (B("\\varnothing"), "\\emptyset", True),
        (B("\\emptyset"), "\\{0\\}", False),
        (B("(4, 3)"), "(3,4)", False),
        (A("1, 2"), "1, 2, 3", False),
        (B("\\{1, 2\\}"), "\\{1,3\\}", False),
        (A("2"), "2, -2", False),
        (B("(1, 2, 4)"), "(1,2,3)", False),
    ],
    "matrix": [
        (B("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}"), "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", True),
        (
            B("\\begin{pmatrix}1 & 0.5\\\\0 & 1\\end{pmatrix}"),
            "\\begin{pmatrix}1&\\frac{1}{2}\\\\0&1\\end{pmatrix}",
            True,
        ),
        (B("\\begin{bmatrix}2\\\\-1\\end{bmatrix}"), "\\begin{pmatrix}2\\\\-1\\end{pmatrix}", True),
        (B("\\begin{pmatrix}1&2\\\\4&3\\end{pmatrix}"), "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", False),
        (B("\\begin{pmatrix}2\\\\1\\end{pmatrix}"), "\\begin{pmatrix}2\\\\-1\\end{pmatrix}", False),
    ],
    "expression_equation": [
        (B("x^2+2x+1"), "(x+1)^2", True),
        (B("2x+2"), "2(x+1)", True),
        (B("y = 2x + 1"), "y=1+2x", True),
        (B("\\frac{x}{2}"), "0.5x", True),
        (B("a^2-b^2"), "(a-b)(a+b)", True),
        (B("x+y=5"), "5-y=x", True),
        (B("x^2+2x"), "(x+1)^2", False),
        (B("2x+1"), "2x-1", False),
        (B("y=2x+1"), "y=2x-1", False),
        (B("x^3"), "3x", False),
        (B("x+y=5"), "x-y=5", False),
        (B("y = 3"), "x=3", False),
        (A("$x = 3$"), "x = 3", True),
    ],
    "log_trig": [
        (B("\\log_2 8"), "3", True),
        (B("\\log_{2} 8"), "3", True),
        (B("\\log_2 8"), "4", False),
        (B("\\ln 8"), "3\\ln 2", True),
        (B("\\ln 8"), "3", False),
        (B("\\sin^2 x + \\cos^2 x"), "1", True),
        (B("\\sin x"), "\\cos x", False),
        (B("\\log_3 10"), "2", False),
    ],
    "complex": [
        (B("1+2i"), "1+2i", True),
        (B("2i+1"), "1+2i", True),
        (B("-i"), "-i", True),
        (B("\\frac{1+i}{2}"), "0.5+0.5i", True),
        (B("3-4i"), "3+4i", False),
        (B("i"), "-i", False),
        (B("1+2i"), "2+i", False),
    ],
    "extraction": [
        ("First I thought \\boxed{3} but rechecking gives \\boxed{5}.", "5", True),
        ("Answer: 4\nWait, that is wrong.\nAnswer: 6", "6", True),
        ("<answer>\n\\boxed{\\frac{1}{2}}\n</answer>", "0.5", True),
        ("We find \\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", True),
        ("**Answer:** 42", "42", True),
        ("ANSWER: $-7$", "-7", True),
        ("Final Answer: The final answer is $12$. I hope it is correct.", "12", True),
        ("answer :   $ 9 $", "9", True),
        ("\\fbox{81}", "81", True),
        ("The result is \\boxed 7", "7", True),
        (
            "<code>print(2+2)</code><interpreter>Answer: 4</interpreter>\nSo the answer is \\boxed{5}",
            "5",
            True,
        ),
        ("<code>print(1)</code>\n<interpreter>\\boxed{99}</interpreter>\nAnswer: 100", "100", True),
        ("\\boxed{\\{1, \\{2\\}\\}}", "\\{1,\\{2\\}\\}", True),
        ("First \\boxed{5} then Answer: 3", "5", False),
        ("Answer: 6\nAnswer: 4", "6", False),
        ("<answer>\\boxed{7}</answer> and finally \\boxed{8}", "7", False),
        ("<code>print(2+2)</code><interpreter>\\boxed{4}</interpreter>\nI am not sure.", "4", False),
        (
            '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(3)"}}\n</tool_call>\n'
            "<tool_response>\n\\boxed{3}\n</tool_response>\nSo the answer is \\boxed{4}",
            "4",
            True,
        ),
        (
            '<tool_call>{"name": "python"}</tool_call><tool_response>Answer: 9</tool_response>\nNo idea.',
            "9",
            False,
        ),
        ("The final answer is:\n\n$\\frac{1}{2}$", "0.5", True),
        ("The final answer is $7$. I hope it is correct.", "8", False),
        ("So\nAnswer: 34<|im_end|>", "34", True),
        ("\\boxed{12}<|endoftext|>", "12", True),
    ],
    "no_answer": [
        ("I don't know how to solve this problem.", "34", False),
        ("The value is 34 but I won't commit.", "34", False),
        ("Let me write code <code>print(34)</code>", "34", False),
        ("\\boxed{", "3", False),
        ("", "1", False),
        ("<interpreter>Answer: 34</interpreter>", "34", False),
        ("The answer might be around 10.", "10", False),
    ],
}


# AIME-style integer answers 0..999: the same integer in several presentations is correct;
# a neighbour, a digit swap or a scaled value is not (labels follow from the construction).
_AIME = [0, 7, 19, 70, 104, 204, 236, 321, 468, 540, 601, 699, 733, 809, 902, 999]
CASES["aime_integer"] = (
    [(A(f"${n}$"), str(n), True) for n in _AIME]
    + [(T(str(n)), str(n), True) for n in _AIME[::2]]
    + [(A(str(n + 1)), str(n), False) for n in _AIME]
    + [(B(str(n)[::-1]), str(n), False) for n in _AIME if int(str(n)[::-1]) != n]
    + [(A(str(n * 10)), str(n), False) for n in _AIME[1:6]]
)
CASES["dapo_format"] = [
    ("Thus the total is 34.\nAnswer: $\\boxed{34}$", "34", True),
    ("Answer:34", "34", True),
    ("answer: 34.", "34", True),
    ("Answer: $34$ ", "34", True),
    ("So we have $x=34$.\n\nAnswer: 34", "34", True),
    ("Answer: \\(113\\)", "113", True),
    ("Answer: $-3$", "-3", True),
    ("Answer: \\frac{1}{2}", "0.5", True),
    ("Answer: 33", "34", False),
    ("Answer: $3$", "-3", False),
    ("Answer: 11.3", "113", False),
    ("Answer: $\\boxed{35}$", "34", False),
    ("Answer: 0.49", "0.5", False),
]


def N(x: str) -> str:  # the answer on the line after "Answer:"
    return f"Both cases agree, so we are done.\nAnswer:\n{x}"


# Answer shapes that models really write (issue 16): each family has right answers and
# tempting wrong ones (a different variable, the other direction, the first value of a chain,
# a dropped or swapped part, a scaled or neighbouring value). Wrong ones outnumber right ones.
CASES["chain"] = [
    (A("m+n = 17"), "17", True),
    (B("x = 5+5+1 = 11"), "11", True),
    (B("5 \\cdot 7 = 35"), "35", True),
    (A("$m + n = 3 + 14 = 17$"), "17", True),
    (B("a+b+c = 2+3+4 = 9"), "9", True),
    (B("2^{10} = 1024"), "1024", True),
    (B("\\frac{6}{8} = \\frac{3}{4}"), "\\frac{3}{4}", True),
    (A("$p+q = 41$"), "41", True),
    (B("x = \\frac{10}{4} = \\frac{5}{2}"), "2.5", True),
    (B("S = 1+2+3 = 6"), "6", True),
    (A("$100 - 28 = 72$"), "72", True),
    (B("x = \\frac{1}{3} \\approx 0.333"), "\\frac13", True),
    (B("3 \\times 4 = 12"), "12", True),
    (A("m+n = 17"), "18", False),
    (B("x = 5+5+1 = 11"), "12", False),
    (B("5 \\cdot 7 = 35"), "5", False),
    (B("5 \\cdot 7 = 35"), "7", False),
    (B("x = 5+5+1 = 12"), "11", False),
    (A("$m + n = 3 + 14 = 18$"), "17", False),
    (B("2^{10} = 1000"), "1024", False),
    (B("\\frac{6}{8} = \\frac{3}{4}"), "\\frac{6}{7}", False),
    (B("x = \\frac{10}{4} = \\frac{5}{2}"), "\\frac{10}{3}", False),
    (A("$100 - 28 = 72$"), "100", False),
    (A("$100 - 28 = 72$"), "28", False),
    (B("x = \\frac{1}{3} \\approx 0.333"), "0.333", False),
    (B("3 \\times 4 = 12"), "3", False),
    (B("a+b+c = 2+3+4 = 10"), "9", False),
    (A("$p+q = 41$"), "14", False),
    (B("S = 1+2+3 = 7"), "6", False),
]
CASES["labelled"] = [
    (B("(p,q)=(3,2)"), "(3,2)", True),
    (B("(3,2)"), "(p,q)=(3,2)", True),
    (B("f(3) = 9"), "9", True),
    (B("9"), "f(3)=9", True),
    (A("$a_{10} = 4$"), "4", True),
    (B("|AB| = 1"), "1", True),
    (B("V_1:V_2 = 11:21"), "11:21", True),
    (B("11:21"), "V_{1}:V_{2}=11:21", True),
    (B("k = 12"), "12", True),
    (B("\\frac{NO}{BO} = \\frac{1}{\\sqrt{6}}"), "\\frac{1}{\\sqrt{6}}", True),
    (B("AB = 4, CD = 5"), "4, 5", True),
    (B("4, 5"), "AB=4, CD=5", True),
    (B("x = 2, y = 3"), "x=2, y=3", True),
    (B("y = 3, x = 2"), "x=2, y=3", True),
    (B("x = -1, x = 2"), "2, -1", True),
    (B("p = -1 \\text{ and } p = \\dfrac{15}{8}"), "-1, \\frac{15}{8}", True),
    (B("(x, y) = (5, 8)"), "(5,8)", True),
    (B("a_{n} = 2n+1"), "2n+1", True),
    (B("f(x) = x^2 + 1"), "x^2+1", True),
    (B("y = 3"), "x=3", False),
    (B("(p,q)=(2,3)"), "(3,2)", False),
    (B("f(3) = 9"), "3", False),
    (B("f(3) = 8"), "9", False),
    (A("$a_{10} = 4$"), "10", False),
    (B("|AB| = 2"), "1", False),
    (B("V_1:V_2 = 21:11"), "11:21", False),
    (B("x = 2, y = 3"), "x=3, y=2", False),
    (B("4, 5"), "AB=5, CD=4", False),
    (B("x = 1, y = 2"), "1, 2, 3", False),
    (B("f(x) = x^2 + 1"), "x^2-1", False),
    (B("a_{n} = 2n+1"), "2n-1", False),
    (B("g(3) = 9"), "f(3)=9", False),
    (B("x = 3"), "y=3", False),
    (B("k = 12"), "k=13", False),
    (B("\\frac{NO}{BO} = \\sqrt{6}"), "\\frac{1}{\\sqrt{6}}", False),
    (B("x = 2"), "x=2, y=3", False),
]
CASES["next_line"] = [
    ("We combine the cases.\nAnswer:\n$17$", "17", True),
    (N("\n\\frac{3}{4}"), "0.75", True),
    ("**Answer:**\n$x = 5$", "5", True),
    (N("  42"), "42", True),
    (N("$(1, 2)$"), "(1,2)", True),
    (N("\\boxed{12}"), "12", True),
    (N("$18$"), "17", False),
    (N("\n\\frac{4}{3}"), "0.75", False),
    ("**Answer:**\n$x = 6$", "5", False),
    (N("(2, 1)"), "(1,2)", False),
    ("Answer: 5\nAnswer:\n7", "5", False),
    ("I could not finish.\nAnswer:\n", "17", False),
]
CASES["several_boxes"] = [
    ("$$\\boxed{(2, 2)} \\quad\\text{and}\\quad \\boxed{(6, 2)}$$", "(2,2), (6,2)", True),
    ("The integers are \\boxed{-2} and \\boxed{1}.", "1, -2", True),
    ("\\boxed{1}, \\boxed{2}, \\boxed{3}", "\\{1,2,3\\}", True),
    ("$$\\boxed{k = 45} \\quad \\text{and} \\quad \\boxed{n = 2}$$", "k=45, n=2", True),
    ("So $x = \\boxed{3}$ or $x = \\boxed{-3}$.", "3, -3", True),
    ("$y_1 = \\boxed{2}$ and $y_2 = \\boxed{5}$", "y_1=2, y_2=5", True),
    ("\\boxed{5}\n\n\\boxed{5}", "5", True),
    ("<answer>\\boxed{1} and \\boxed{4}</answer>", "1, 4", True),
    ("First I guessed \\boxed{3}, but checking again gives \\boxed{5}.", "5", True),
    ("$$\\boxed{(2, 2)} \\quad\\text{and}\\quad \\boxed{(6, 3)}$$", "(2,2), (6,2)", False),
    ("The integers are \\boxed{-2} and \\boxed{1}.", "1", False),
    ("The integers are \\boxed{-2} and \\boxed{1}.", "-2", False),
    ("\\boxed{1}, \\boxed{2}", "1, 2, 3", False),
    ("First I guessed \\boxed{3}, but checking again gives \\boxed{5}.", "3", False),
    ("$$\\boxed{k = 45} \\quad \\text{and} \\quad \\boxed{n = 3}$$", "k=45, n=2", False),
    ("$y_1 = \\boxed{5}$ and $y_2 = \\boxed{2}$", "y_1=2, y_2=5", False),
    ("\\boxed{4} \\quad \\boxed{6}", "6", False),
    ("<answer>\\boxed{1} and \\boxed{4}</answer>", "4", False),
]
CASES["units_words"] = [
    (B("4\\pi \\text{ cm}^2"), "4\\pi", True),
    (B("125\\textnormal{ miles}"), "125", True),
    (A("28 percent"), "28\\%", True),
    (A("28 pct"), "28\\%", True),
    (B("28\\text{ percent}"), "28\\%", True),
    (B("28\\%"), "28", True),
    (A("15 square units"), "15", True),
    (B("6\\text{ cm}"), "6", True),
    (A("$36 \\text{ inches}$"), "36", True),
    (A("The area is $24$ square feet."), "24", True),
    (A("$3$ hours"), "3", True),
    (A("\\$1,250"), "1250", True),
    (B("4\\pi \\text{ cm}^2"), "2\\pi", False),
    (B("4 \\text{ cm}^2"), "4\\pi", False),
    (B("125\\textnormal{ miles}"), "12.5", False),
    (A("27 percent"), "28\\%", False),
    (A("28 pct"), "82\\%", False),
    (B("15\\text{ square units}"), "16", False),
    (A("The area is $24$ square feet."), "42", False),
    (A("$3$ hours"), "4", False),
    (A("\\$1,250"), "125", False),
    (B("6\\text{ cm}"), "60", False),
    (B("28\\%"), "2.8", False),
]
CASES["inequality_interval"] = [
    (B("5 \\geq x"), "x \\leq 5", True),
    (B("-x > -1"), "x < 1", True),
    (B("0<f(x)<1"), "(0,1)", True),
    (B("x \\ge 2"), "x \\geq 2", True),
    (A("$x >= 5$"), "x \\geq 5", True),
    (B("2 < x \\leq 7"), "(2,7]", True),
    (B("x \\in (2, 7]"), "2 < x \\le 7", True),
    (B("x > 3"), "(3,\\infty)", True),
    (B("x \\leq -1"), "(-\\infty,-1]", True),
    (B("-793 < a < 10"), "(-793, 10)", True),
    (B("2x \\leq 10"), "x \\leq 5", True),
    (B("x \\neq 3"), "x != 3", True),
    (B("(3, \\infty)"), "x > 3", True),
    (B("3 < x"), "x > 3", True),
    (B("x \\geq 5"), "x \\leq 5", False),
    (B("5 \\leq x"), "x \\leq 5", False),
    (B("-x > -1"), "x > 1", False),
    (B("x < 1"), "x \\leq 1", False),
    (B("0 \\leq f(x) < 1"), "(0,1)", False),
    (B("x > 3"), "[3,\\infty)", False),
    (B("x > 3"), "(-\\infty,3)", False),
    (B("y > 3"), "x > 3", False),
    (B("2 < x < 7"), "(2,7]", False),
    (B("x \\in [2, 7)"), "2 < x \\le 7", False),
    (B("-2x \\leq 10"), "x \\leq -5", False),
    (B("x \\neq 3"), "x \\neq -3", False),
    (B("-793 < a < 11"), "(-793, 10)", False),
    (B("x^2 < 4"), "x < 2", False),
]
CASES["set_expression"] = [
    (B("\\{1,3\\}\\cup\\{2,4\\}"), "\\{1,2,3,4\\}", True),
    (B("\\{1,2,3\\}\\cap\\{2,3,4\\}"), "\\{2,3\\}", True),
    (B("\\{1,2,3\\}\\setminus\\{2\\}"), "\\{1,3\\}", True),
    (B("(-\\infty,1)\\cup(2,\\infty)"), "(2,\\infty)\\cup(-\\infty,1)", True),
    (B("[0,1]\\cup[1,2]"), "[0,2]", True),
    (B("\\{2, 4, 6\\}"), "\\{6, 4, 2\\}", True),
    (B("\\pm 3"), "3, -3", True),
    (B("\\{1,3\\}\\cup\\{3,5\\}"), "\\{1,3,5\\}", True),
    (B("\\{1,3\\}\\cup\\{2,4\\}"), "\\{1,2,3\\}", False),
    (B("\\{1,2,3\\}\\cap\\{2,3,4\\}"), "\\{1,2,3,4\\}", False),
    (B("\\{1,2,3\\}\\setminus\\{2\\}"), "\\{2\\}", False),
    (B("(-\\infty,1)\\cup(2,\\infty)"), "(-\\infty,1]\\cup(2,\\infty)", False),
    (B("[0,1]\\cup[2,3]"), "[0,3]", False),
    (B("\\{2, 4, 6\\}"), "\\{2, 4\\}", False),
    (B("\\pm 3"), "3", False),
    (B("\\{1,3\\}\\cup\\{5\\}"), "\\{1,3\\}", False),
]
_M12 = "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}"
CASES["matrix_forms"] = [
    (B("\\begin{bmatrix}1&2\\\\3&4\\end{bmatrix}"), _M12, True),
    (B("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}"), _M12, True),
    (
        B("\\begin{pmatrix}0.5 & 0.25\\\\ 1 & 0\\end{pmatrix}"),
        "\\begin{pmatrix}\\frac{1}{2}&\\frac{1}{4}\\\\1&0\\end{pmatrix}",
        True,
    ),
    (B("\\left[\\begin{array}{cc}1 & 2 \\\\3 & 4\\end{array}\\right]"), _M12, True),
    (
        B("\\begin{pmatrix}\\frac{3}{5}\\\\ -\\frac{4}{5}\\end{pmatrix}"),
        "\\begin{pmatrix}0.6\\\\-0.8\\end{pmatrix}",
        True,
    ),
    (
        B("\\begin{pmatrix}\\sqrt{4} & 0 \\\\ 0 & 2\\end{pmatrix}"),
        "\\begin{pmatrix}2&0\\\\0&2\\end{pmatrix}",
        True,
    ),
    (B("\\begin{pmatrix}x+1 & 0\\end{pmatrix}"), "\\begin{pmatrix}1+x&0\\end{pmatrix}", True),
    (B("\\begin{bmatrix}1&2\\\\3&4\\end{bmatrix}"), "\\begin{pmatrix}1&3\\\\2&4\\end{pmatrix}", False),
    (
        B("\\begin{pmatrix}0.33 & 0.25\\\\ 1 & 0\\end{pmatrix}"),
        "\\begin{pmatrix}\\frac{1}{3}&\\frac{1}{4}\\\\1&0\\end{pmatrix}",
        False,
    ),
    (B("\\begin{pmatrix}1&2\\end{pmatrix}"), "\\begin{pmatrix}1\\\\2\\end{pmatrix}", False),
    (B("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}"), "\\begin{pmatrix}1&2\\\\3&5\\end{pmatrix}", False),
    (
        B("\\begin{pmatrix}\\frac{3}{5}\\\\ \\frac{4}{5}\\end{pmatrix}"),
        "\\begin{pmatrix}0.6\\\\-0.8\\end{pmatrix}",
        False,
    ),
    (B(_M12), "(1,2,3,4)", False),
    (B("\\begin{pmatrix}2&0\\\\0&2\\end{pmatrix}"), "2", False),
]
CASES["equation_forms"] = [
    (B("y = -\\frac12x + \\frac34"), "2x+4y-3=0", True),
    (B("2x+4y-3=0"), "y=-\\frac{1}{2}x+\\frac{3}{4}", True),
    (B("\\frac{x^2}{16} + \\frac{y^2}{12} = \\frac14"), "\\frac{x^2}{4}+\\frac{y^2}{3}=1", True),
    (B("-34x-45y+20z-100=0"), "34x+45y-20z+100=0", True),
    (B("x = \\frac{y-1}{2}"), "y=2x+1", True),
    (B("3x - 6 = 0"), "x - 2 = 0", True),
    (B("y - 2x = 1"), "y = 2x + 1", True),
    (B("x^2 + y^2 = 25"), "25 - x^2 = y^2", True),
    (B("(x-1)^2 + (y+2)^2 = 9"), "x^2 - 2x + y^2 + 4y - 4 = 0", True),
    (B("y = -\\frac12x + \\frac34"), "2x+4y+3=0", False),
    (B("2x+4y-3=0"), "y=\\frac{1}{2}x+\\frac{3}{4}", False),
    (B("\\frac{x^2}{16} + \\frac{y^2}{12} = 1"), "\\frac{x^2}{4}+\\frac{y^2}{3}=1", False),
    (B("x(2x+4y-3) = 0"), "2x+4y-3=0", False),
    (B("y = 2x - 1"), "y = 2x + 1", False),
    (B("y - 2x = -1"), "y = 2x + 1", False),
    (B("x^2 + y^2 = 5"), "x^2 + y^2 = 25", False),
    (B("y = 2x + 1"), "x = 2y + 1", False),
    (B("2x+4y-3"), "2x+4y-3=0", False),
    (B("x^2 = 4"), "x = 2", False),
]
CASES["radical_order"] = [
    (B("2\\sqrt{33}+15"), "15+2\\sqrt{33}", True),
    (
        B("\\frac{\\sqrt{\\sqrt{11}+\\sqrt{194}}}{2\\sqrt{33}+15}"),
        "\\frac{\\sqrt{\\sqrt{11}+\\sqrt{194}}}{15+2\\sqrt{33}}",
        True,
    ),
    (B("\\sqrt{5}+3"), "3+\\sqrt{5}", True),
    (B("\\sqrt{3}\\cdot 2 + 1"), "1+2\\sqrt{3}", True),
    (B("\\frac{\\sqrt{2}+1}{3}"), "\\frac{1+\\sqrt{2}}{3}", True),
    (B("-\\sqrt{7}+4"), "4-\\sqrt{7}", True),
    (B("\\sqrt{6}\\sqrt{2}"), "2\\sqrt{3}", True),
    (B("2\\sqrt{33}-15"), "15+2\\sqrt{33}", False),
    (B("\\sqrt{33}+15"), "15+2\\sqrt{33}", False),
    (
        B("\\frac{\\sqrt{\\sqrt{11}+\\sqrt{194}}}{2\\sqrt{33}-15}"),
        "\\frac{\\sqrt{\\sqrt{11}+\\sqrt{194}}}{15+2\\sqrt{33}}",
        False,
    ),
    (B("\\sqrt{5}+2"), "3+\\sqrt{5}", False),
    (B("\\sqrt{7}-4"), "4-\\sqrt{7}", False),
    (B("\\sqrt{3}+2"), "1+2\\sqrt{3}", False),
    (B("\\frac{\\sqrt{2}-1}{3}"), "\\frac{1+\\sqrt{2}}{3}", False),
]
# The false accepts of issue 16 and their relatives: a division by zero is never a value, and a
# comma list is never a number unless it is written as one (1-3 digits, then groups of 3, no space).
CASES["zero_division_and_lists"] = [
    (B("1:00"), "12:00", False),
    (B("3:00"), "12:00", False),
    (B("7:0"), "5:0", False),
    (B("\\frac{2}{0}"), "\\frac{1}{0}", False),
    (B("\\frac{1}{0}"), "1", False),
    (B("\\frac{0}{0}"), "0", False),
    (B("32, 349"), "32349", False),
    (B("2336"), "2, 336", False),
    (A("2, 336"), "2336", False),
    (B("1, 000"), "1000", False),
    (B("12, 345"), "12345", False),
    (B("1,5"), "15", False),
    (B("1,0000"), "10000", False),
    (B("12:00"), "12:00", True),
    (B("32,349"), "32349", True),
    (B("32{,}349"), "32349", True),
    (B("32,\\!349"), "32349", True),
    (B("2, 336"), "2, 336", True),
]
CASES["answer_line_math"] = [
    (A("The area is $12$."), "12", True),
    (A("the smallest value is $\\frac{1}{2}$"), "0.5", True),
    (A("$x = 2$ or $x = 3$"), "2, 3", True),
    (A("The area is $12$."), "21", False),
    (A("Since $x=2$, we get $y=5$."), "2", False),
    (A("$x = 2$ or $x = 3$"), "2", False),
]
# Issue #37's recall rules: each right answer it now accepts, beside the wrong answers that
# look like it (false-accept probes). Labels by reading, as everywhere in this file.
CASES["decimal_comma"] = [
    (A("1000,99"), "1000.99", True),
    (A("2,74"), "2.74", True),
    (A("0,111"), "0.111", True),
    (B("1.22"), "1,22", True),
    (A("1,222"), "1.222", False),  # three digits after the comma: thousands, never a guess
    (A("1, 22"), "1.22", False),  # a space after the comma: a list
    (A("1000,98"), "1000.99", False),
    (A("2,47"), "2.74", False),
    (A("1,22"), "12.2", False),
    (B("1.22"), "1, 22", False),  # the gold is a list: no decimal reading
]
CASES["prose_value"] = [
    ("Final Answer: The largest $n$ is 34.", "34", True),
    (A("the number is not 10 which is 1,000.99€"), "1000.99", True),
    (A("so the number is 10 which is 1,000.99m²"), "1000.99", True),
    ("Final Answer: Jane started growing Sphere 3 hours ago. I hope it is correct.", "3", True),
    (A("First $x = 4$. Therefore, the probability that Alice wins is 2/3"), "2/3", True),
    (A("The answer is $3$, not $4$."), "3", True),
    (A("The answer is $3$, not $4$."), "4", False),  # the negated value is never the answer
    (A("It is 12 or 13, I am not sure."), "13", False),  # a hedge picks nothing
    (A("It is 12 or 13, I am not sure."), "12", False),
    (A("We have 5 apples and 3 pears"), "3", False),  # several values, no statement verb
    (A("First we get 7. Then the answer is 8."), "7", False),  # only the last sentence
    ("Final Answer: The largest $n$ is 34.", "35", False),
    (A("The number is not 10 which is 1,000.99€"), "10", False),
]
CASES["approximation"] = [
    (B("0.0833333333333333"), "\\frac{1}{12}", True),
    (B("2.6667"), "\\frac{8}{3}", True),
    (B("\\sqrt{17}"), "4.123105625617661", True),
    (B("4.123105625617661"), "\\sqrt{17}", True),
    (B("(0.6,2.6667]"), "(\\frac{3}{5},\\frac{8}{3}]", True),
    (B("0.33"), "\\frac{1}{3}", False),  # too few significant digits
    (B("0.3333"), "\\frac{1}{3}", False),
    (B("2.6666"), "\\frac{8}{3}", False),  # not the rounding
    (B("0.1250001"), "\\frac{1}{8}", False),  # 1/8 needs no rounding: only 0.125 is it
    (B("3.14159"), "\\pi", False),  # an irrational needs a double's digits
    (B("4.12310562561767"), "\\sqrt{17}", False),  # 15 digits, not the rounding
    (B("4.1231056256"), "\\sqrt{17}", False),  # the rounding, too few digits
    (B("4.123105625617662"), "\\sqrt{17}", False),
    (B("2.66667"), "2.6667", False),  # two decimals: exact
    (B("(0.6,2.6667)"), "(\\frac{3}{5},\\frac{8}{3}]", False),
    (
        B("\\begin{pmatrix}0.33\\\\0.2\\end{pmatrix}"),
        "\\begin{pmatrix}\\frac{1}{3}\\\\\\frac{1}{5}\\end{pmatrix}",
        False,
    ),
]
CASES["sets_relations"] = [
    (B("x \\in [-2,7]"), "-2 \\le x \\le 7", True),
    (B("-2 \\le x \\le 7"), "x \\in [-2,7]", True),
    (B("-2 \\\\le x \\\\le 7"), "x \\in [-2,7]", True),
    (B("{1,3}"), "(1,3)", True),
    (B("(5,2),(7,2)"), "p=5,q=2;p=7,q=2", True),
    (
        B("z \\in \\left[-\\frac{3}{2}, -1\\right] \\cup \\left[1, \\frac{3}{2}\\right]"),
        "1\\leq|z|\\leq \\frac{3}{2}",
        True,
    ),
    (B("x \\in [-2,7)"), "-2 \\le x \\le 7", False),
    (B("x \\in [-2,7]"), "-2 < x \\le 7", False),
    (B("{1,3}"), "(3,1)", False),
    (B("{1,3}"), "[1,3]", False),  # a closed interval is no pair
    (B("(2,5),(2,7)"), "p=5,q=2;p=7,q=2", False),
    (B("(5,2)"), "p=5,q=2;p=7,q=2", False),
    (B("z \\in [1, \\frac{3}{2}]"), "1\\leq|z|\\leq \\frac{3}{2}", False),
    (B("z \\in (-\\frac{3}{2}, -1) \\cup (1, \\frac{3}{2})"), "1\\leq|z|\\leq \\frac{3}{2}", False),
]
CASES["boxes_parts"] = [
    ("$$\\boxed{(3, 3)} \\text{ for part (a) and } \\boxed{(1, 1)}$$", "(3, 3), (1, 1)", True),
    ("$$\\boxed{(3, 3)} \\text{ for part (a) and } \\boxed{(1, 1)}$$", "(1, 1)", False),
    ("$$\\boxed{(3, 3)} \\text{ for part (a) and } \\boxed{(1, 2)}$$", "(3, 3), (1, 1)", False),
]


def main() -> None:
    out = Path(__file__).with_name("reward_cases.jsonl")
    n = 0
    with out.open("w") as fh:
        for category, cases in CASES.items():
            for response, truth, correct in cases:
                fh.write(
                    json.dumps(
                        {
                            "category": category,
                            "response": response,
                            "ground_truth": truth,
                            "correct": correct,
                        }
                    )
                    + "\n"
                )
                n += 1
    print(f"wrote {n} cases to {out}")


if __name__ == "__main__":
    main()
