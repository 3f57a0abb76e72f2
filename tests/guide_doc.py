"""The operator's guide (docs/operators.md) and the README read as tests: fenced blocks, their markers, expected
output and the kimictl commands in them. Loaded by path from tests/unit and tests/sandbox (not a test module).

A block's info string is its language and its marks: ```bash sandbox exit=3``` -> lang "bash", marks
["sandbox"], attrs {"exit": "3"} (docs/operators.md, "How this guide is tested").
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "operators.md"
README = ROOT / "README.md"
SANDBOX_DIR = "/var/tmp/kimictl-sandbox"   # the guide's sandbox directory; tests put theirs in its place
SHELL_LANGS = ("bash", "sh", "shell", "console")
MARKS = {"bash": {"sandbox", "hardware", "setup"}, "console": {"offline"}}

_FENCE = re.compile(r"^ {0,3}```(.*)$")


@dataclass
class Block:
    path: Path
    line: int            # 1-based line of the opening fence
    lang: str
    marks: list[str]
    attrs: dict[str, str]
    text: str
    output: Block | None = field(default=None, repr=False)   # the ```text output``` block right after this one

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def exit(self) -> int:
        return int(self.attrs.get("exit", 0))


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a markdown file, with each `text output` block attached to the block before it."""
    out: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    last_end = -1
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        words = m.group(1).split()
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and not _FENCE.match(lines[i]):
            body.append(lines[i])
            i += 1
        b = Block(path, start + 1, words[0] if words else "", [w for w in words[1:] if "=" not in w],
                  dict(w.split("=", 1) for w in words[1:] if "=" in w), "\n".join(body) + "\n")
        adjacent = out and all(not ln.strip() for ln in lines[last_end + 1:start])
        if b.lang == "text" and "output" in b.marks and adjacent:
            out[-1].output = b
        out.append(b)
        last_end = i
        i += 1
    return out


def anchors(path: Path = GUIDE) -> set[str]:
    """Explicit anchors (`<a id="...">`) of a markdown file."""
    return set(re.findall(r'<a id="([^"]+)"></a>', path.read_text()))


def row(anchor: str, path: Path = GUIDE) -> str:
    """The table row (one line) that holds `<a id="anchor">`."""
    for line in path.read_text().splitlines():
        if f'<a id="{anchor}"></a>' in line:
            return line
    raise AssertionError(f"{path.name} has no row with anchor {anchor}")


def _pattern(line: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(p) for p in line.rstrip().split("...")))


def missing_lines(expected: str, actual: str) -> list[str]:
    """Expected lines not found in `actual`, in order: each must match a later line of it whole ('...' within a
    line matches any text; a line of only '...' stands for lines left out and is skipped). Empty when all match."""
    got = [ln.rstrip() for ln in actual.splitlines()]
    wanted = [w for w in expected.splitlines() if w.strip() and w.strip() != "..."]
    pos = 0
    for n, want in enumerate(wanted):
        pat = _pattern(want)
        hit = next((k for k in range(pos, len(got)) if pat.fullmatch(got[k])), None)
        if hit is None:
            return wanted[n:]
        pos = hit + 1
    return []


def _logical_lines(text: str) -> list[str]:
    """Shell lines with backslash continuations joined and heredoc bodies left out."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i].strip()
        out.append(line)
        i += 1
        m = re.search(r"<<-?\s*'?\"?(\w+)'?\"?", line)
        if m:   # skip the heredoc body up to its terminator
            while i < len(lines) and lines[i].strip() != m.group(1):
                i += 1
            i += 1
    return out


def kimictl_invocations(text: str) -> list[list[str]]:
    """The argument lists of every `kimictl ...` command in shell text (`$ ` prompts allowed)."""
    out: list[list[str]] = []
    for line in _logical_lines(text):
        try:
            lex = shlex.shlex(line.removeprefix("$ "), posix=True, punctuation_chars=True)
            lex.commenters = "#"
            lex.whitespace_split = True
            tokens = list(lex)
        except ValueError:
            continue
        for k, tok in enumerate(tokens):
            if tok == "kimictl" and (k == 0 or tokens[k - 1] in ("|", ";", "&&", "||", "(", "$(")):
                args = []
                for t in tokens[k + 1:]:
                    if t in ("|", ";", "&&", "||", ")", ">", ">>", "<", "2>", "&"):
                        break
                    args.append(t)
                out.append(args)
    return out


def inline_invocations(path: Path) -> list[list[str]]:
    """`kimictl ...` code spans of a markdown file (usage lines: placeholders and [optional] parts allowed); a word
    with alternatives (`pull|verify|status`) yields one invocation per alternative."""
    out: list[list[str]] = []
    for span in re.findall(r"`(kimictl [^`]+)`", path.read_text()):
        words = span.replace("\\|", "|").replace("[", " ").replace("]", " ").split()[1:]
        alts = [[]]
        for w in words:
            if "|" in w and not w.startswith("-") and not any(a and a[-1].startswith("-") for a in alts):
                alts = [[*a, choice] for a in alts for choice in w.split("|") if choice]
            else:
                alts = [[*a, w] for a in alts]
        out += alts
    return out


def flags(args: list[str]) -> list[str]:
    """Option names used in an argument list (`--set=x` -> `--set`; `--host/--role` -> both)."""
    out: list[str] = []
    for a in args:
        for part in a.split("/"):
            m = re.match(r"^(--?[A-Za-z][\w-]*)", part)
            if m and not re.match(r"^-\d", part):
                out.append(m.group(1))
    return out


def plan_summary_table(path: Path = GUIDE) -> list[list[str]]:
    """Rows (cells, backticks removed) of the markdown table after `<!-- doctest: plan-summary -->`."""
    lines = path.read_text().splitlines()
    start = lines.index("<!-- doctest: plan-summary -->") + 1
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().strip("`") for c in line.strip().strip("|").split("|")])
    return rows[2:]   # without the header and its rule
