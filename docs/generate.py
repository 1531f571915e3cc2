"""The parts of the docs that show the code, written from the code, so that they never drift from it:

- in README.md, each function named in a `<!-- generated: code FILE FUNCTION -->` marker, and the diff between
  two scripts of a `<!-- generated: diff FILE FILE -->` marker (their functions, not their docstrings; its hunks
  without line numbers, which an edit made alike to both scripts moves);
- in docs/flags.md, the table of every flag (`<!-- generated: flags -->`), from the scripts' own parsers;
- in docs/long-runs.md, what a resume does with each flag (`<!-- generated: resume-rules -->`), from config.ON_RESUME.

    python docs/generate.py          # rewrite them after a change to the code
    python docs/generate.py --check  # exit 1, naming what is out of date (tests/test_readme.py runs this)

A generated part runs from its marker to `<!-- end generated -->`; edit the code, then run this.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = (REPO / "README.md", REPO / "docs" / "flags.md", REPO / "docs" / "long-runs.md")
PART = re.compile(r"(<!-- generated: (.+?) -->\n)(.*?)(<!-- end generated -->)", re.DOTALL)
END = "<!-- end generated -->"


def function_source(file: str, name: str) -> str:
    """The source of the top-level function `name` of `file`, as it is written there."""
    text = (REPO / file).read_text()
    node = next(node for node in ast.parse(text).body if getattr(node, "name", None) == name)
    return ast.get_source_segment(text, node, padded=True)


def functions_of(file: str) -> list[str]:
    """A script's lines from its first function on: what differs between the scripts, without their docstrings
    (which say how each is started) and imports."""
    lines = (REPO / file).read_text().splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith("def ")):]


def flags_table() -> str:
    sys.path.insert(0, str(REPO))
    from multi_train_utils.cli import FLAGS, LAUNCH_FLAGS, MULTI_PROCESS_FLAGS, SPAWN_FLAGS

    rows = ["| flag | scripts | default | what it does |", "| --- | --- | --- | --- |"]
    for flags, scripts in ((FLAGS, "all"), (MULTI_PROCESS_FLAGS, "launch, spawn"), (SPAWN_FLAGS, "spawn"),
                           (LAUNCH_FLAGS, "launch")):
        for names, options in flags.items():
            if options.get("help") != argparse.SUPPRESS:
                default = options.get("default")
                shown = "" if default in (None, "") else f"`{default}`"
                rows.append(f"| `{names.split()[0]}` | {scripts} | {shown} | {options['help'].replace('|', '/')} |")
    return "\n".join(rows)


def resume_rules_table() -> str:
    sys.path.insert(0, str(REPO))
    from multi_train_utils.config import APPLIED, BOUND, THIS_COMMAND, field_names, flag_name, rule_of

    rows = ["| flag | on resume | why |", "| --- | --- | --- |"]
    order = {BOUND: 0, APPLIED: 1, THIS_COMMAND: 2}
    for name in sorted(field_names(), key=lambda name: order[rule_of(name)[0]]):
        rows.append(f"| `{flag_name(name)}` | {rule_of(name)[0]} | {rule_of(name)[1]} |")
    return "\n".join(rows)


def generated(what: str) -> str:
    kind, *names = what.split()
    if kind == "code":
        return f"```python\n{function_source(*names)}\n```\n"
    if kind == "diff":
        diff = difflib.unified_diff(functions_of(names[0]), functions_of(names[1]), *names, lineterm="", n=0)
        # Hunks without their line numbers: the same lines added to every script leave the diff as it was.
        return "```diff\n" + "\n".join("@@" if line.startswith("@@") else line for line in diff) + "\n```\n"
    if kind == "flags":
        return flags_table() + "\n"
    if kind == "resume-rules":
        return resume_rules_table() + "\n"
    raise ValueError(f"unknown generated part {what!r}")


def regenerate(text: str) -> str:
    return PART.sub(lambda part: f"{part[1]}{generated(part[2])}{part[4]}", text)


def stale_parts() -> list[str]:
    """What is out of date, one line each."""
    stale = []
    for page in PAGES:
        text = page.read_text()
        for part in PART.finditer(text):
            if part[3] != generated(part[2]):
                stale.append(f"{page.relative_to(REPO)}: its copy of `{part[2]}` is out of date; run python "
                             "docs/generate.py")
    return stale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a part is out of date")
    if parser.parse_args().check:
        stale = stale_parts()
        print("\n".join(stale) or "every generated part is up to date")
        sys.exit(1 if stale else 0)
    for page in PAGES:
        page.write_text(regenerate(page.read_text()))


if __name__ == "__main__":
    main()
