"""The README and the docs pages as the tests read them: one place that knows where the documented
commands live, so a test asserts on the command a user reads, wherever that page now is.

    from tests.docs_text import readme_commands, command_line
    main = readme_commands()[0]
    line = command_line("python -m trainer +parallel=tp mesh=[4] ", "bad-configs.md")
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def read_docs(*names: str) -> str:
    """The text of the named docs pages (``"bad-configs.md"``), in order; with no names, the README and
    every page under ``docs/``. A name that is not a page fails loudly rather than reading nothing."""
    paths = [DOCS / name for name in names] if names else [README, *sorted(DOCS.rglob("*.md"))]
    missing = [str(p.relative_to(REPO)) for p in paths if not p.is_file()]
    assert not missing, f"no such docs page: {missing}"
    return "\n".join(p.read_text() for p in paths)


def readme() -> str:
    return README.read_text()


def blocks(text: str, language: str = "bash") -> list[list[str]]:
    """The non-empty lines of each fenced block of ``language`` in ``text``, in order."""
    return [[line for line in body.splitlines() if line.strip()]
            for lang, body in _FENCE.findall(text) if lang == language]


def readme_blocks(language: str = "bash") -> list[list[str]]:
    """The README's ``language`` blocks: bash's first is the main command, its second the export and
    generate commands that read the main run's checkpoint, its third the test command."""
    return blocks(readme(), language)


def readme_commands() -> list[str]:
    """Every line of the README's bash blocks, in the order a reader meets them."""
    return [line for block in readme_blocks() for line in block]


def command_line(prefix: str, *names: str) -> str:
    """The one documented command line starting with ``prefix`` in the named pages (all, without names)."""
    found = [line for block in blocks(read_docs(*names)) for line in block if line.startswith(prefix)]
    assert len(set(found)) == 1, f"expected one documented line starting {prefix!r}, found {found}"
    return found[0]


def readme_links() -> list[str]:
    """The README's relative link targets (no anchors, no web addresses)."""
    return [target.split("#")[0] for target in _LINK.findall(readme())
            if "://" not in target and not target.startswith("#")]


COMMAND_FENCES = ("bash", "sh", "shell", "")  # fenced blocks a reader types from; ```text and ```yaml are not


def documented_commands() -> list[tuple[str, str]]:
    """Every ``python -m ...`` command of the README and the docs pages, as a reader types it:
    ``(page, command)`` in page order (:func:`command_blocks`)."""
    return [(str(path.relative_to(REPO)), command) for path in [README, *sorted(DOCS.rglob("*.md"))]
            for block in command_blocks(path) for command in block]


def command_blocks(path: Path) -> list[list[str]]:
    """The ``python -m ...`` commands of each fenced block of a page that has some: continuation lines
    (``\\``) joined, the shell comment dropped. A line chaining installs (``pip install ... && python -m
    trainer``) gives its ``python -m`` part; two commands side by side on one line (``docs/multi-host.md``'s
    two hosts) give the first."""
    found = []
    for lang, body in _FENCE.findall(path.read_text()):
        if lang not in COMMAND_FENCES:
            continue
        commands = []
        for line in re.sub(r"\\\n\s*", " ", body).splitlines():
            if line[:1].isspace():  # a command starts a line; indented text is a listing's (code-layout.md's tree)
                continue
            command = _without_comment(line).split("&&")[-1].strip()
            if command.startswith("python -m ") or re.match(r"^(\w+=('[^']*'|\S+) )+python -m ", command):
                commands.append(re.split(r"\s{3,}", command)[0])
        if commands:
            found.append(commands)
    return found


def _without_comment(line: str) -> str:
    """``line`` up to its shell comment: a ``#`` outside quotes that starts a word."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()
