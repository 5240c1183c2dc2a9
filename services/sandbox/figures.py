"""A session cell's plots, as Jupyter's inline backend shows them: one ``image/png`` per open figure.

After each cell ``session_main`` calls ``take_figures``: every figure matplotlib holds open is
rendered to PNG (``bbox_inches="tight"``, as the inline backend does) and closed, and comes
back as Jupyter display data ``{"text/plain": "<Figure size 640x480 with 1 Axes>",
"image/png": "<base64>"}`` — what SandboxFusion's ``/run_jupyter`` returns for a plot.

Invariants: nothing happens unless the cell's process already imported ``matplotlib.pyplot``
(no import here, so sessions that never plot pay nothing); at most ``MAX_FIGURES`` images
and ``MAX_PNG_BYTES`` of PNG per cell (the rest are listed as text only); any failure while
rendering (the cell may have broken matplotlib) gives text-only entries, never an exception.
"""

from __future__ import annotations

import base64
import io
import sys
from typing import Any

MAX_FIGURES = 16
MAX_PNG_BYTES = 2 * 1024 * 1024  # the cell's whole reply must stay under session_runner.MAX_RESULT_FRAME
_modules = sys.modules


def take_figures(*, _b64: Any = base64.b64encode, _bytes_io: Any = io.BytesIO,
                 _exc: type[BaseException] = BaseException) -> list[dict[str, str]]:
    """Display data of every open figure, oldest first; closes them (names bound at import)."""
    plt = _modules.get("matplotlib.pyplot")
    if plt is None:
        return []
    shown: list[dict[str, str]] = []
    try:
        numbers = list(plt.get_fignums())
    except _exc:  # noqa: BLE001 - pyplot broken by the cell
        return []
    budget = MAX_PNG_BYTES
    for number in numbers:
        try:
            fig = plt.figure(number)
            text = repr(fig)
        except _exc:  # noqa: BLE001
            continue
        entry = {"text/plain": text}
        if len(shown) < MAX_FIGURES and budget > 0:
            try:
                buf = _bytes_io()
                fig.savefig(buf, format="png", bbox_inches="tight")
                png = buf.getvalue()
                if len(png) <= budget:
                    entry["image/png"] = _b64(png).decode()
                    budget -= len(png)
            except _exc:  # noqa: BLE001 - a figure that cannot render is shown as text
                pass
        shown.append(entry)
    try:  # noqa: SIM105 - contextlib.suppress is looked up when it exits
        plt.close("all")
    except _exc:  # noqa: BLE001
        pass
    return shown
