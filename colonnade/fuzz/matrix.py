"""The support matrix, generated from the validator's rules (never written by hand).

Each feature (:data:`FEATURES`) is a set of config overrides on :data:`BASE`, a tiny model.
A pair of features composes when the validator (:func:`problems_by_rule`) accepts both
overrides together on the world they need (tp x pp x cp x dp, with dp raised until
ep x expert_tp divides tp x cp x dp); two features that set one field differently are the same
axis ('—'). :func:`table` gives the ✓ / ✗ / — table of any list of features (the README's
short one, :data:`README_FEATURES`), :func:`page` the whole docs page with, for every refused
pair, the rule and the message the user would get. ``colonnade bench fuzz --matrix PATH``
writes the page; a test fails when the committed page differs from :func:`page`.
"""

from __future__ import annotations

import functools
from typing import Any

from colonnade.config.load import ConfigError, config_from_dict
from colonnade.config.validate import problems_by_rule, resolve

FEATURES: dict[str, dict[str, dict[str, Any]]] = {
    "tp2": {"parallel": {"tp": 2, "sp": False}},
    "tp2+sp": {"parallel": {"tp": 2, "sp": True}},
    "1F1B": {"parallel": {"pp": 2, "schedule": "1f1b"}},
    "interleaved": {"parallel": {"pp": 2, "vp": 2, "schedule": "interleaved_1f1b"}},
    "ZB-H1": {"parallel": {"pp": 2, "schedule": "zb_h1"}},
    "ZB-V": {"parallel": {"pp": 2, "vp": 2, "schedule": "zbv"}},
    "cp ring": {"parallel": {"cp": 2, "cp_attention": "ring"}},
    "cp a2a": {"parallel": {"cp": 2, "cp_attention": "all_to_all"}},
    "cp hier": {"parallel": {"cp": 4, "cp_attention": "hierarchical", "cp_a2a_size": 2}},
    "ZeRO-1": {"parallel": {"dp": 2, "zero_stage": 1}},
    "ZeRO-2": {"parallel": {"dp": 2, "zero_stage": 2}},
    "ZeRO-3": {"parallel": {"dp": 2, "zero_stage": 3}},
    "MoE ep2": {"model": {"num_experts": 4, "moe_top_k": 2}, "parallel": {"ep": 2}},
    "recompute": {"training": {"recompute": "full"}},
    "uneven pp": {"parallel": {"pp": 2, "schedule": "1f1b", "pipeline_layout": [1, 3]}},
    "hybrid ZeRO-3": {"parallel": {"dp": 4, "zero_stage": 3, "zero_shard_size": 2}},
    "expert tp2": {"model": {"num_experts": 4, "moe_top_k": 2},
                   "parallel": {"ep": 2, "expert_tp": 2}},
    "MoE all_gather": {"model": {"num_experts": 4, "moe_top_k": 2},
                       "parallel": {"ep": 2, "moe_dispatcher": "all_gather"}},
    "MoE capacity": {"model": {"num_experts": 4, "moe_top_k": 2,
                               "moe_capacity_factor": 1.0}},
    "dropout": {"model": {"hidden_dropout": 0.1, "attention_dropout": 0.1}},
    "doc resets": {"data": {"reset_position_ids": True, "reset_attention_mask": True}},
    "bf16": {"training": {"precision": "bf16"}},
}
"""Every feature of the docs page, as config overrides of :data:`BASE`."""

README_FEATURES: tuple[str, ...] = (
    "tp2", "tp2+sp", "1F1B", "interleaved", "ZB-H1", "ZB-V", "cp ring", "cp a2a", "cp hier",
    "ZeRO-1", "ZeRO-2", "ZeRO-3", "MoE ep2", "expert tp2", "dropout", "recompute")
"""The README's short table: the parallel axes, schedules, ZeRO stages, MoE, dropout and
recompute."""

BASE: dict[str, dict[str, Any]] = {
    "model": {"num_layers": 4, "hidden_size": 64, "num_heads": 8, "vocab_size": 256,
              "max_seq_len": 64},
    "training": {"seq_len": 32, "micro_batch_size": 2, "microbatches": 4, "steps": 10,
                 "device": "cpu"},
}
"""The tiny model every cell starts from."""


@functools.cache
def judge_pair(names: tuple[str, ...]) -> tuple[str, tuple[tuple[str, str], ...]]:
    """('✓', ()) when the validator accepts the features together, ('✗', its (rule,
    message) problems) when it refuses them, ('—', ()) when two set one field differently."""
    sections: dict[str, dict[str, Any]] = {k: dict(v) for k, v in BASE.items()}
    for name in names:
        for section, fields in FEATURES[name].items():
            into = sections.setdefault(section, {})
            if any(into.get(k, v) != v for k, v in fields.items()):
                return "—", ()
            into.update(fields)
    par = sections.setdefault("parallel", {})
    stage = par.get("tp", 1) * par.get("cp", 1)
    folded = par.get("ep", 1) * (par.get("expert_tp") or 1)
    while (stage * par.get("dp", 1)) % folded:  # ep x expert_tp fold inside tp x cp x dp
        par["dp"] = 2 * par.get("dp", 1)
    world = stage * par.get("pp", 1) * par.get("dp", 1)
    try:
        found = problems_by_rule(resolve(config_from_dict(sections), world), world)
    except ConfigError as err:
        found = [("load", str(err))]
    return ("✗", tuple(found)) if found else ("✓", ())


def table(names: tuple[str, ...] | list[str]) -> str:
    """The markdown table of every pair of ``names`` (the diagonal: the feature alone)."""
    rows = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        cells = [judge_pair((a,) if a == b else (a, b))[0] for b in names]
        rows.append(f"| {a} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def refusals(names: tuple[str, ...] | list[str]) -> list[str]:
    """One markdown item per refusal: each feature refused alone, then each pair (once)
    refused for a reason neither feature alone has, with the rule and message of each
    problem."""
    out = []
    pairs = [(a,) for a in names] + [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    for pair in pairs:
        mark, found = judge_pair(pair)
        alone = {p for name in pair for p in judge_pair((name,))[1]} if len(pair) > 1 else set()
        new = [p for p in found if p not in alone]
        if mark != "✗" or not new:
            continue
        out.append(f"- **{pair[0]}** alone:" if len(pair) == 1
                   else f"- **{pair[0]}** with **{pair[1]}**:")
        out += [f"  - `{rule}`: {message}" for rule, message in new]
    return out


def page() -> str:
    """docs/support_matrix.md, whole."""
    names = list(FEATURES)
    features = [f"- {name}: " + ", ".join(f"`{s}.{k}={v}`" for s, f in over.items()
                                          for k, v in f.items())
                for name, over in FEATURES.items()]
    base = ", ".join(f"`{s}.{k}={v}`" for s, f in BASE.items() for k, v in f.items())
    return "\n".join([
        "# Support matrix",
        "",
        "Generated from the validator's rules by `colonnade bench fuzz --matrix "
        "docs/support_matrix.md` (`colonnade/fuzz/matrix.py`); `tests/fuzz/test_matrix.py` "
        "fails when this page is stale. Do not edit it by hand.",
        "",
        "Every pair of features on a tiny model, as `colonnade/config/validate.py` judges it: "
        "✓ accepted, ✗ refused before any rank starts (the rule and its message are listed "
        "below the table), — the same axis (two settings of one field). The world is what "
        "the pair needs (tp x pp x cp x dp; dp raised until ep x expert_tp divides "
        "tp x cp x dp). Accepted is not the same as proven: `colonnade bench fuzz` draws "
        "whole configurations over this space and checks each accepted one against its "
        "single-process run ([testing](testing.md#the-fuzzer)).",
        "",
        f"Base: {base}. Features:",
        "",
        *features,
        "",
        table(names),
        "",
        "## What is refused, and why",
        "",
        "Each feature refused on its own, then each pair refused for a reason that neither "
        "feature has alone (a pair with a feature refused alone is refused for that reason "
        "too). The rule is the validator function that raised the message "
        "(`colonnade.config.validate.problems_by_rule`).",
        "",
        *refusals(names),
        "",
    ])
