"""What the synthetic engine writes: ReTool-shaped turns, as token ids, decided from the context.

One turn (one ``generate`` call of the agent loop) is: reasoning text, then either a ``<code>`` block
of real Python ending in ``</code>`` (the agent's tool stop) or the final answer
(``<answer>\\boxed{X}</answer>`` then EOS). The engine decides it like a model, from its context: the
number of interpreter blocks already in it (a truncated-geometric number of code blocks per
response, mean ``tool_calls_mean``, at most ``max_tool_calls``) and, for the answer, the problem: a
prompt holding ``Problem #<k>`` has the answer ``answer_for(k)``; the engine writes it with
probability ``correct_rate`` and ``answer_for(k) + 1`` otherwise.

Invariants: the same (context, random stream) gives the same turn; reasoning text never contains a
stop string or the word the block counter looks for; every snippet is valid Python whose run time
scales with ``code_cost`` (``error_rate`` of them raise, as model code does); the log-prob of a token
is a pure function of (weights fingerprint, token, position): ``synthetic_logprob``.
"""

from __future__ import annotations

import random
import re
from typing import Any

from services.rollout.engine.synthetic_config import SyntheticEngineConfig

REASONING = [
    " Let me set up the problem carefully before computing anything.",
    " We need to count the configurations that satisfy both conditions.",
    " First, note that the expression is symmetric in the two variables.",
    " By the triangle inequality the remaining side must be shorter than the sum of the others.",
    " Rather than expand by hand, it is safer to check the algebra with a short computation.",
    " The constraint forces the sum of the digits to be divisible by three.",
    " So the number of valid pairs equals the number of lattice points inside the region.",
    " Hmm, that does not match the earlier estimate, so one of the cases was double counted.",
    " Let me verify the boundary cases separately, since they are easy to miss.",
    " Using the substitution t = x + 1/x, the quartic becomes a quadratic in t.",
    " The probability is the ratio of favourable outcomes to the total number of outcomes.",
    " Wait, the modulus should be taken before dividing, otherwise the fraction is not an integer.",
    " Now the recurrence gives the next few terms, and a pattern appears with period six.",
    " The area splits into two right triangles with legs that we already know.",
    " This confirms the value; the remaining step is to simplify the fraction to lowest terms.",
    " Since the polynomial has integer coefficients, any rational root divides the constant term.",
]

SNIPPETS: dict[str, list[str]] = {
    "arithmetic": [
        "total = 0\nfor a in range(1, {n}):\n    if (a * a + 3 * a) % 7 == 2:\n"
        "        total += a\nprint(total)",
        "import math\nbest = max(math.gcd(k, {n} - k) * k % 97 for k in range(1, {n}))\nprint(best)",
        "digits = sum(int(c) for k in range(1, {n}) for c in str(k * k))\nprint(digits % 1000)",
    ],
    "itertools": [
        "from itertools import product\ncount = sum(1 for a, b in product(range(int({n} ** 0.5)), repeat=2)"
        " if (a * b) % 5 == 1)\nprint(count)",
        "from itertools import combinations\nvals = range(1, 3 + {n} // 200)\n"
        "print(sum(1 for c in combinations(vals, 3) if sum(c) % 4 == 0))",
        "from itertools import permutations\nprint(sum(1 for p in permutations(range(7)) if p[0] < p[-1]))",
    ],
    "fractions": [
        "from fractions import Fraction\ns = sum(Fraction(1, k * (k + 1)) for k in range(1, {n}))\nprint(s)",
        "from fractions import Fraction\nx = Fraction(0)\nfor k in range(1, {n} // 10):\n"
        "    x = 1 / (1 + x)\nprint(x.limit_denominator(1000))",
    ],
    "sympy": [
        "import sympy as sp\nx = sp.symbols('x')\nprint(sp.solve(x**3 - 6*x**2 + 11*x - 6, x))",
        "import sympy as sp\nprint(sp.factorint({n} * 2**5 * 3**3 + 1))",
        "from sympy import Rational, simplify, sqrt\nprint(simplify((sqrt(12) + sqrt(27)) / sqrt(3) "
        "+ Rational({n}, 7)))",
        "import sympy as sp\nn = sp.symbols('n', integer=True, positive=True)\n"
        "print(sp.summation(n**2, (n, 1, {n})))",
    ],
}

ERRORS = [
    "print(undefined_name + 1)",
    "values = [1, 2, 3]\nprint(values[10])",
    "print(1 / 0)",
]

_PROBLEM = re.compile(r"Problem #(\d+)")


def answer_for(problem_id: int) -> int:
    """The ground truth of synthetic problem ``problem_id`` (what ``bench/scale.py`` writes as its row)."""
    return (problem_id * 7919 + 13) % 1000


_TABLE_RNG = random.Random(20_240_601)
_LOGPROBS = [-_TABLE_RNG.expovariate(1.25) for _ in range(1 << 16)]


def synthetic_logprob(fingerprint: int, token: int, position: int) -> float:
    """The synthetic policy's log-prob of ``token`` at ``position`` (prompt + response index) under the
    weights with ``fingerprint``: a pure function (teacher-forceable), a table lookup (cheap per token)."""
    return _LOGPROBS[(fingerprint + token * 40503 + position * 9973) & 0xFFFF]


class Script:
    """Pre-tokenized material and the turn planner of one engine (one tokenizer)."""

    def __init__(self, tokenizer: Any, cfg: SyntheticEngineConfig, eos_id: int | None) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.sentences = [tokenizer.encode(s, add_special_tokens=False) for s in REASONING]
        mix = cfg.code_mix
        self.families = [f for f in SNIPPETS if getattr(mix, f) > 0]
        self.family_weights = [getattr(mix, f) for f in self.families]
        marker = tokenizer.encode("interpreter", add_special_tokens=False)
        self.block_id = marker[0] if len(marker) == 1 else None
        p = 1.0 / (cfg.tool_calls_mean + 1.0)
        self.answer_hazard = p  # truncated geometric: P(answer now | k blocks so far) = p, 1 at the cap

    # ---- reading the context -------------------------------------------------------------------
    def blocks_in(self, context: list[int]) -> int:
        """Interpreter blocks in ``context`` (each has an opening and a closing tag)."""
        if self.block_id is not None:
            return context.count(self.block_id) // 2
        return self.tokenizer.decode(context).count("</interpreter>")

    def problem_id(self, context: list[int]) -> int | None:
        found = _PROBLEM.search(self.tokenizer.decode(context[:4096]))
        return int(found.group(1)) if found else None

    # ---- one turn ------------------------------------------------------------------------------
    def turn(self, context: list[int], rng: random.Random) -> list[int]:
        """The tokens the engine means to write after ``context``."""
        blocks = self.blocks_in(context)
        out = self._reasoning(rng)
        if blocks >= self.cfg.max_tool_calls or rng.random() < self.answer_hazard:
            pid = self.problem_id(context)
            right = answer_for(pid) if pid is not None else 0
            value = right if rng.random() < self.cfg.correct_rate else right + 1
            out += self.tokenizer.encode(f"\n\nAnswer: <answer>\\boxed{{{value}}}</answer>",
                                         add_special_tokens=False)
            if self.eos_id is not None:
                out.append(self.eos_id)
            return out
        out += self.tokenizer.encode(f"\n\n<code>\n```python\n{self._code(rng)}\n```\n</code>",
                                     add_special_tokens=False)
        return out

    def filler(self, rng: random.Random, tokens: int) -> list[int]:
        """More reasoning, when a turn ran out of script before any stop (e.g. no EOS id)."""
        out: list[int] = []
        while len(out) < tokens:
            out += self.sentences[rng.randrange(len(self.sentences))]
        return out

    def _reasoning(self, rng: random.Random) -> list[int]:
        target = max(1, int(self.cfg.reasoning_tokens_mean * rng.uniform(0.5, 1.5)))
        out: list[int] = []
        while len(out) < target:
            out += self.sentences[rng.randrange(len(self.sentences))]
        return out

    def _code(self, rng: random.Random) -> str:
        if rng.random() < self.cfg.error_rate:
            return rng.choice(ERRORS)
        family = rng.choices(self.families, self.family_weights)[0]
        return rng.choice(SNIPPETS[family]).replace("{n}", str(self.cfg.code_cost + rng.randrange(100)))
