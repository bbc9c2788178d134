"""Shared fixtures of the workflow tests: a small corpus and its prepared dataset."""

from __future__ import annotations

from pathlib import Path

import pytest

from colonnade.config.load import load_config
from colonnade.training.setup import prepare_data
from tests.reliability.jobs import tiny_args, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(text directory, prepared directory), prepared once per module."""
    root = tmp_path_factory.mktemp("workflow_data")
    text = write_corpus(root / "text", docs=3, words=1200)
    prepared = root / "prepared"
    prepare_data(load_config(None, tiny_args(text, prepared, root / "unused")), log=False)
    return text, prepared
