"""Each list of allowed values has one owner (config/choices.py); the implementations match it."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from colonnade.config import choices
from colonnade.config.load import ConfigError
from colonnade.config.sections import Config
from colonnade.config.validate import validate
from colonnade.models.build import DTYPES
from colonnade.optim.lr import lr_at
from colonnade.pipeline.schedules import SCHEDULES

PACKAGE = Path(__file__).resolve().parents[2] / "colonnade"


def _tuple_literals() -> dict[tuple[str, ...], list[str]]:
    """Every tuple of 2+ string constants in the package, with where it appears."""
    out: dict[tuple[str, ...], list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple) and len(node.elts) >= 2 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                key = tuple(sorted(e.value for e in node.elts))  # type: ignore[attr-defined]
                out.setdefault(key, []).append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return out


def test_no_list_of_allowed_values_is_declared_twice() -> None:
    literals = _tuple_literals()
    owned = {name: value for name, value in vars(choices).items()
             if name.isupper() and isinstance(value, tuple) and name not in _aliases()}
    assert len(owned) >= 15
    for name, value in owned.items():
        where = literals.get(tuple(sorted(value)), [])
        assert where == [f"config/choices.py:{_line(name)}"], (name, where)


def _aliases() -> set[str]:
    """Lists that name another owner's list (``OPTIM_DTYPES = GRAD_REDUCE_DTYPES``)."""
    return {node.target.id for node in ast.parse((PACKAGE / "config" / "choices.py")
                                                  .read_text()).body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and isinstance(node.value, ast.Name)}


def _line(name: str) -> int:
    for node in ast.parse((PACKAGE / "config" / "choices.py").read_text()).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name:
            return node.value.lineno  # type: ignore[union-attr]
    raise AssertionError(name)


def test_implementations_cover_their_lists() -> None:
    assert tuple(SCHEDULES) == choices.SCHEDULES
    assert tuple(DTYPES) == choices.PRECISIONS
    for decay in choices.LR_DECAYS:
        cfg = dataclasses.replace(Config().optim, decay=decay, warmup_steps=0)
        assert lr_at(1, 10, cfg) > 0.0


@pytest.mark.parametrize(("field", "value"), [
    ("model.arch", "gpt3"), ("parallel.schedule", "1f2b"), ("training.precision", "fp8"),
    ("training.recompute", "some"), ("optim.decay", "cos"), ("data.format", "chat"),
    ("optim.state_dtype", "fp16"), ("optim.master_dtype", "fp8"),
])
def test_validator_rejects_values_outside_the_owned_list(field: str, value: str) -> None:
    section, name = field.split(".")
    cfg = Config()
    cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section),
                                                                   **{name: value})})
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(cfg, 1)
