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
