"""Worker process: reads ``[pred, truth]`` JSON lines, answers ``true``/``false`` lines.

The line ``"clear"`` empties the parse cache (answer ``true``); benchmarks use it so that a
timed batch cannot reuse parses from an earlier run.
"""

from __future__ import annotations

import ctypes
import json
import signal
import sys

from services.reward.symbolic import clear_cache, symbolic_equal

WARM_UP = [  # exercise the lazily imported parts of sympy before saying ready: a first check
    # must not pay for imports out of its CPU-time limit
    ("\\frac{1}{2}", "0.5"),
    ("\\sqrt{12}", "2\\sqrt{3}"),
    ("x^2+2x+1", "(x+1)^2"),
    ("\\{1,2\\}", "\\{2,1\\}"),
    ("[0,1)", "[0,1)"),
    ("y=2x+1", "y=1+2x"),
    ("1+2i", "2i+1"),
    ("\\frac{3\\pi}{2}", "\\frac{3}{2}\\pi"),
    ("\\log_{5}25", "2"),
    ("\\ln 27", "3\\ln 3"),
    ("\\sin^2 t+\\cos^2 t", "1"),
    ("\\tan^2 x + 1", "\\sec^2 x"),
    ("e^{2}", "\\exp(2)"),
    ("\\binom{5}{2}", "10"),
    ("5!", "120"),
    ("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}"),
    ("\\begin{pmatrix}1\\end{pmatrix}+\\begin{pmatrix}1\\end{pmatrix}", "\\begin{pmatrix}2\\end{pmatrix}"),
    ("5\\geq x", "x\\leq5"),
    ("-x>-1", "x<1"),
    ("2x+4y-3=0", "y=-\\frac{1}{2}x+\\frac{3}{4}"),
    ("\\{1,3\\}\\cup\\{2,4\\}", "\\{1,2,3,4\\}"),
    ("[0,1]\\cup[1,2]", "[0,2]"),
    ("12:00", "1:00"),
]


def _die_with_parent() -> None:
    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def main() -> None:
    _die_with_parent()
    for pred, truth in WARM_UP:
        symbolic_equal(pred, truth)
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if request == "clear":
            clear_cache()
            out.write("true\n")
        else:
            pred, truth = request
            out.write("true\n" if symbolic_equal(pred, truth) else "false\n")
        out.flush()


if __name__ == "__main__":
    main()
