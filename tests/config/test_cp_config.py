"""Context-parallel configuration rules (config/validate.py ``_context``): each violated rule's
message names the fields and the fix, and valid cp layouts pass."""

from __future__ import annotations

import pytest

from colonnade.config.sections import Config, ModelConfig, ParallelConfig, TrainingConfig
from colonnade.config.validate import problems, resolve


def _problems(world: int, model: dict[str, object] | None = None,
              training: dict[str, object] | None = None, **par: object) -> list[str]:
    config = Config(model=ModelConfig(**(model or {})),  # type: ignore[arg-type]
                    parallel=ParallelConfig(**par),  # type: ignore[arg-type]
                    training=TrainingConfig(**(training or {})))  # type: ignore[arg-type]
    return problems(resolve(config, world), world)


TINY = {"hidden_size": 32, "num_heads": 4, "num_layers": 2, "max_seq_len": 64}


@pytest.mark.parametrize(("world", "model", "training", "par"), [
    (2, TINY, {"seq_len": 16}, {"cp": 2}),
    (4, TINY, {"seq_len": 16}, {"cp": 4}),
    (4, TINY, {"seq_len": 16}, {"cp": 2, "tp": 2, "sp": True}),
    (4, TINY, {"seq_len": 16}, {"cp": 2, "cp_attention": "all_to_all", "tp": 2}),
    (2, {**TINY, "num_kv_heads": 1}, {"seq_len": 16}, {"cp": 2, "cp_attention": "all_to_all"}),
    (4, {**TINY, "attention_dropout": 0.1}, {"seq_len": 16},
     {"cp": 4, "cp_attention": "all_to_all"}),
    (2, {**TINY, "attention_dropout": 0.1}, {"seq_len": 16}, {"cp": 2}),
    (8, {**TINY, "num_kv_heads": 2, "attention_dropout": 0.1}, {"seq_len": 32},
     {"cp": 8, "cp_attention": "hierarchical", "cp_a2a_size": 2}),  # cp 8 > 4 heads
    (2, TINY, {"seq_len": 16}, {"cp": 2, "cp_attention": "hierarchical", "cp_a2a_size": 1}),
    (1, TINY, {"seq_len": 30, "memory_limit_gb": 2.5}, {}),
])
def test_valid_cp_layouts(world: int, model: dict[str, object], training: dict[str, object],
                          par: dict[str, object]) -> None:
    assert _problems(world, model, training, **par) == []


@pytest.mark.parametrize(("world", "model", "training", "par", "fragments"), [
    (2, TINY, {"seq_len": 30}, {"cp": 2},
     ["training.seq_len=30 is not divisible by 2 x parallel.cp = 4: the zigzag split cuts "
      "each sequence into 4 equal chunks and each of the 2 cp ranks holds 2 of them; pick a "
      "seq_len that is a multiple of 4 (e.g. 32), or change cp."]),
    (4, TINY, {"seq_len": 20}, {"cp": 2, "tp": 2, "sp": True},
     ["training.seq_len=20 is not divisible by 2 x parallel.cp x tp=8", "parallel.sp=true"]),
    (8, TINY, {"seq_len": 32}, {"cp": 8, "cp_attention": "all_to_all"},
     ["parallel.cp_attention='all_to_all' needs model.num_heads / parallel.tp = 4 divisible "
      "by parallel.cp=8", "use parallel.cp_attention='ring'"]),
    (8, {**TINY, "num_kv_heads": 2}, {"seq_len": 32}, {"cp": 4, "tp": 2,
                                                        "cp_attention": "all_to_all"},
     ["model.num_heads / parallel.tp = 2 divisible by parallel.cp=4"]),
    (2, {**TINY, "num_heads": 6, "hidden_size": 48, "num_kv_heads": 3}, {"seq_len": 16},
     {"cp": 2, "cp_attention": "all_to_all"},
     ["model.num_kv_heads / parallel.tp = 3 divisible by parallel.cp=2 or dividing it",
      "change cp, tp or num_kv_heads"]),
    (2, TINY, {"seq_len": 16}, {"cp": 2, "cp_attention": "ulysses"},
     ["parallel.cp_attention='ulysses' is unknown; use one of ring, all_to_all, hierarchical"]),
    (4, TINY, {"seq_len": 16}, {"cp": 4, "cp_a2a_size": 2},
     ["parallel.cp_a2a_size=2 is used only by parallel.cp_attention='hierarchical' (got "
      "'ring'); set cp_attention='hierarchical' or unset cp_a2a_size."]),
    (4, TINY, {"seq_len": 16}, {"cp": 4, "cp_attention": "hierarchical"},
     ["parallel.cp_attention='hierarchical' needs parallel.cp_a2a_size", "one of [1, 2, 4]"]),
    (4, TINY, {"seq_len": 16}, {"cp": 4, "cp_attention": "hierarchical", "cp_a2a_size": 3},
     ["parallel.cp_a2a_size=3 must divide parallel.cp=4", "use one of [1, 2, 4]"]),
    (8, TINY, {"seq_len": 32}, {"cp": 8, "cp_attention": "hierarchical", "cp_a2a_size": 8},
     ["needs model.num_heads / parallel.tp = 4 divisible by parallel.cp_a2a_size=8",
      "use cp_a2a_size in [1, 2, 4]"]),
    (4, {**TINY, "num_heads": 6, "hidden_size": 48, "num_kv_heads": 3}, {"seq_len": 16},
     {"cp": 4, "cp_attention": "hierarchical", "cp_a2a_size": 2},
     ["model.num_kv_heads / parallel.tp = 3 divisible by parallel.cp_a2a_size=2 or "
      "dividing it", "use cp_a2a_size in [1], or change tp or num_kv_heads"]),
    (8, {**TINY, "num_kv_heads": 2}, {"seq_len": 24},
     {"cp": 8, "cp_attention": "hierarchical", "cp_a2a_size": 4},
     ["training.seq_len=24 is not divisible by 2 x parallel.cp = 16"]),
    (1, TINY, {"seq_len": 16, "memory_limit_gb": 0.0}, {},
     ["training.memory_limit_gb=0.0 must be > 0", "unset it for no limit"]),
    (8, TINY, {"seq_len": 32}, {"cp": 2, "tp": 2, "sp": True, "tp_comm_chunks": 3},
     ["not divisible by parallel.cp=2 x tp=2 x tp_comm_chunks=3"]),
])
def test_cp_rules(world: int, model: dict[str, object], training: dict[str, object],
                  par: dict[str, object], fragments: list[str]) -> None:
    found = _problems(world, model, training, **par)
    text = "\n".join(found)
    for fragment in fragments:
        assert fragment in text, text
