"""Shared fixtures of the workflow tests: the reliability tests' small corpus and its prepared
dataset (one definition, imported)."""

from __future__ import annotations

from tests.reliability.conftest import corpus

__all__ = ["corpus"]
