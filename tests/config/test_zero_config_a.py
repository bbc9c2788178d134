"""ZeRO configuration: the effective stage, the reshard default, every rule's message, the
command line's error for a bad value, and the checkpoint's recorded stage (old 'zero1' too)."""

from __future__ import annotations

import pytest

from colonnade.checkpoint.training_state import zero_stage_of
from colonnade.cli import main
from colonnade.config.sections import Config, ParallelConfig
from colonnade.config.validate import problems, resolve
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import plan_groups, zero_partitions


def _problems(world: int = 4, **par: object) -> list[str]:
    config = Config(parallel=ParallelConfig(**par))  # type: ignore[arg-type]
    return problems(resolve(config, world), world)


@pytest.mark.parametrize(("stage", "flag", "want"),
                         [(0, False, 0), (0, True, 1), (1, False, 1), (2, True, 2), (3, False, 3)])
def test_effective_stage(stage: int, flag: bool, want: int) -> None:
    assert ParallelConfig(zero_stage=stage, use_distributed_optimizer=flag).zero == want


def test_reshard_default_follows_pp() -> None:
    assert ParallelConfig(pp=1).reshard is True
    assert ParallelConfig(pp=2).reshard is False
    assert ParallelConfig(pp=2, reshard_after_forward=True).reshard is True
    assert ParallelConfig(pp=1, reshard_after_forward=False).reshard is False


@pytest.mark.parametrize(("par", "fragment"), [
    ({"zero_stage": 4}, "parallel.zero_stage=4 is unknown; use 0, 1, 2 or 3"),
    ({"zero_stage": -1}, "parallel.zero_stage=-1 is unknown"),
    ({"zero_stage": 2, "zero_prefetch": -1}, "parallel.zero_prefetch=-1 must be >= 0"),
    ({"grad_reduce_dtype": "fp16"}, "parallel.grad_reduce_dtype='fp16' is unknown; use one of "
                                    "fp32, bf16"),
    ({"zero_shard_size": 2}, "parallel.zero_shard_size=2 needs a ZeRO stage >= 1"),
    ({"zero_stage": 2, "zero_shard_size": 3}, "parallel.zero_shard_size=3 does not divide "
                                              "dp x cp = 4"),
    ({"zero_stage": 3, "zero_shard_size": 0}, "parallel.zero_shard_size=0 must be >= 1"),
    ({"zero_stage": 2, "reshard_after_forward": True},
     "parallel.reshard_after_forward=True applies to ZeRO stage 3 only (the stage is 2"),
])
def test_rules_name_field_and_fix(par: dict[str, object], fragment: str) -> None:
    found = _problems(**par)
    assert any(fragment in p for p in found), found


@pytest.mark.parametrize("par", [{"zero_stage": 2, "zero_shard_size": 2},
                                 {"use_distributed_optimizer": True, "zero_shard_size": 4},
                                 {"zero_stage": 3, "zero_prefetch": 0, "grad_reduce_dtype": "bf16",
                                  "reshard_after_forward": False}])
def test_valid_zero_configs(par: dict[str, object]) -> None:
    assert _problems(**par) == []


def test_cli_bad_stage_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--print-config", "--parallel.zero_stage=7"]) == 2
    err = capsys.readouterr().err
    assert "parallel.zero_stage=7 is unknown; use 0, 1, 2 or 3" in err, err


def test_hybrid_partitions() -> None:
    """dp4: shard groups are consecutive pairs, replicate groups the same index of each."""
    parts = zero_partitions([[0, 1, 2, 3], [4, 5, 6, 7]], 2)
    assert parts["zero_shard"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert parts["zero_replicate"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    plan = plan_groups(ParallelDims(tp=2, dp=4), zero_shard_size=2)
    assert plan["zero_shard"].partition == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert plan["zero_replicate"].partition == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert "zero_shard" not in plan_groups(ParallelDims(dp=4))


def test_checkpoint_records_stage_and_reads_old_zero1() -> None:
    assert zero_stage_of({"layout": {"zero": 3}}) == 3
    assert zero_stage_of({"layout": {"zero1": True}}) == 1
    assert zero_stage_of({"layout": {"zero1": False}}) == 0
    assert zero_stage_of({}) == 0
