"""User-facing help names no issue numbers: every ``colonnade`` command's --help, the config
field list (--help-config), the ``colonnade bench`` listing and each benchmark script's --help
(its description and option help, read from the source, not run). `colonnade bench` listed
"Context parallelism (issue 16) on CPU: ..." and "Issue 19's table: ..."."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from colonnade.bench import available, describe
from colonnade.cli import _config_help, build_parser

ISSUE = re.compile(r"\bissue\b", re.IGNORECASE)


def _helps(parser: argparse.ArgumentParser) -> list[str]:
    """The --help text of ``parser`` and of each of its subcommands."""
    texts = [parser.format_help()]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                texts += _helps(sub)
    return texts


def _script_help(script: Path) -> list[str]:
    """What ``python script --help`` can show: the module docstring (the description) and the
    string parts of every ``help=`` / ``description=`` / ``epilog=`` argument."""
    tree = ast.parse(script.read_text())
    texts = [ast.get_docstring(tree) or ""]
    for node in ast.walk(tree):
        for kw in node.keywords if isinstance(node, ast.Call) else []:
            if kw.arg in ("help", "description", "epilog"):
                texts += [c.value for c in ast.walk(kw.value)
                          if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return texts


def test_colonnade_help_names_no_issue() -> None:
    texts = [*_helps(build_parser()), _config_help()]
    assert [t for t in texts if ISSUE.search(t)] == []


@pytest.mark.parametrize("name", sorted(available()))
def test_benchmark_help_names_no_issue(name: str) -> None:
    script = available()[name]
    found = [line for text in [describe(script), *_script_help(script)]
             for line in text.splitlines() if ISSUE.search(line)]
    assert found == [], f"benchmarks/{name}.py"
