"""docs/support_matrix.md is the page colonnade/fuzz/matrix.py generates from the validator's
rules: stale (a rule changed, a feature added) it fails, printing the command that rewrites it.
"""

from __future__ import annotations

from pathlib import Path

from colonnade.fuzz.matrix import judge_pair, page

PAGE = Path(__file__).resolve().parents[2] / "docs" / "support_matrix.md"


def test_support_matrix_page_is_the_validators() -> None:
    want = page()
    assert PAGE.read_text(encoding="utf-8") == want, (
        "docs/support_matrix.md is stale; regenerate it with "
        "`colonnade bench fuzz --matrix docs/support_matrix.md`")
    assert "✓" in want and "✗" in want and "`moe`: " in want  # it can fail both ways


def test_a_refused_pair_names_its_rule() -> None:
    mark, found = judge_pair(("tp2", "MoE ep2"))
    assert mark == "✗" and [rule for rule, _ in found] == ["moe"]
    assert "parallel.sp=true" in found[0][1]
    assert judge_pair(("tp2", "tp2+sp")) == ("—", ())
    assert judge_pair(("tp2+sp", "cp a2a")) == ("✓", ())
