"""The README and docs/ stay true: every relative link resolves (file and heading), and every
``retool …`` command they show exists in the CLI with the options it is shown with."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(\s*)(```+|~~~+)(.*)$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# "retool" after -n/--namespace is a Kubernetes namespace, not our CLI
COMMAND = re.compile(r"(?:^|(?<!-n)(?<!--namespace)[\s;&|(=])(?:[\w./-]*/)?retool\s+(.+)")
SHELL_STOP = {"&", "&&", "|", "||", ";", ">", ">>", "<", "<<", "2>&1"}
PLACEHOLDERS = {"…", "...", "DIR", "FILE"}


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _split(text: str) -> tuple[list[str], list[str]]:
    """(prose lines with code fences removed, code lines: fenced blocks and inline code spans)."""
    prose, code, fence = [], [], None
    lines = text.splitlines()
    for line in lines:
        m = FENCE.match(line)
        if m and fence is None:
            fence = m.group(2)
            continue
        if m and fence is not None and m.group(2).startswith(fence[0]) and not m.group(3).strip():
            fence = None
            continue
        if fence is not None:
            code.append(line)
        else:
            prose.append(line)
            code.extend(span for _, span in INLINE_CODE.findall(line))
    joined: list[str] = []  # shell continuation lines joined
    for line in code:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + " " + line.strip()
        else:
            joined.append(line)
    return prose, joined


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = _split(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for line in prose:
        m = re.match(r"^#{1,6}\s+(.+?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    prose, _ = _split(path.read_text())
    text = "\n".join(INLINE_CODE.sub("", line) for line in prose)
    bad = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    return bad


def _cli() -> Any:
    from services.cli import app

    return typer.main.get_command(app)


def _is_group(cmd: Any) -> bool:
    return isinstance(getattr(cmd, "commands", None), dict)  # typer vendors click: no isinstance


def _option_names(cmd: Any) -> set[str]:
    names = {"--help"}
    for p in cmd.params:
        names.update(getattr(p, "opts", []))
        names.update(getattr(p, "secondary_opts", []))
    return names


def check_command(root: Any, words: str) -> str | None:
    """None when ``retool <words>`` names a command and only options it has; else what is wrong."""
    try:
        tokens = shlex.split(words, comments=True)
    except ValueError:
        tokens = words.split()
    cmd: Any = root
    path = ["retool"]
    for token in tokens:
        token = token.strip("[]")
        if token in SHELL_STOP or token.startswith("#"):
            break
        if _is_group(cmd) and not token.startswith("-"):
            if token in PLACEHOLDERS:
                return None
            sub = cmd.commands.get(token)
            if sub is None:
                return f"`{' '.join(path)} {token}`: no such command (has {sorted(cmd.commands)})"
            cmd, path = sub, [*path, token]
            continue
        if token.startswith("-") and len(token) > 1 and not re.match(r"^-\d", token):
            name = token.split("=", 1)[0]
            if name not in _option_names(cmd):
                return f"`{' '.join(path)}` has no option {name}"
    return None


def bad_commands(path: Path, root: Any) -> list[str]:
    _, code = _split(path.read_text())
    bad = []
    for line in code:
        for m in COMMAND.finditer(line):
            problem = check_command(root, m.group(1))
            if problem:
                bad.append(f"{m.group(0).strip()}: {problem}")
    return bad


@pytest.mark.parametrize("path", docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    assert not broken_links(path), broken_links(path)


@pytest.mark.parametrize("path", docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_retool_commands_exist(path: Path) -> None:
    root = _cli()
    assert not bad_commands(path, root), bad_commands(path, root)


def test_the_docs_show_commands():
    """The command check has something to check: the README shows the main ones."""
    _, code = _split((ROOT / "README.md").read_text())
    shown = {m.group(1).split()[0] for line in code for m in COMMAND.finditer(line)}
    assert {"sandbox", "reward", "rollout", "trainer", "demo"} <= shown, shown


def test_the_checks_can_fail(tmp_path: Path) -> None:
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## A section\n")
    page.write_text(
        "# Page\n\n[ok](other.md#a-section) [gone](missing.md) [bad anchor](other.md#nope)\n"
        "[self](#page) [web](https://example.com)\n\n"
        "```bash\nretool trainer run --config x.yaml \\\n  --nope 1\nretool trainer fly\n"
        "retool sandbox serve --port 1 --dry-run &\n```\n\n"
        "Inline: `retool reward grade --response a --ground-truth b` and `retool data …`.\n"
    )
    links = [b.split(":")[0] for b in broken_links(page)]
    assert links == ["missing.md", "other.md#nope"]
    problems = bad_commands(page, _cli())
    assert len(problems) == 2 and "--nope" in problems[0] and "fly" in problems[1], problems
    assert slug("Retries: tenacity (`services/common/retry.py`)") == "retries-tenacity-servicescommonretrypy"
    assert slug("Rollout–trainer mismatch") == "rollouttrainer-mismatch"
