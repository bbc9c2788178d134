"""THE validation table: every invalid configuration we know, rejected before any process group
exists, with a message that names the fields at fault and a fix.

Each row is (id, world size, overrides of a valid tiny base config, substrings the message must
contain). Adding a rule to :mod:`colonnade.config.validate` means adding its row here.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch.distributed as dist

from colonnade.config.load import ConfigError, config_from_dict
from colonnade.config.validate import resolve, validate

BASE: dict[str, dict[str, Any]] = {
    "model": {"num_layers": 4, "hidden_size": 64, "num_heads": 8, "vocab_size": 256,
              "max_seq_len": 64},
    "training": {"seq_len": 32, "micro_batch_size": 2, "steps": 10, "device": "cpu"},
}
MISSING = "/nonexistent/colonnade"

TABLE: list[tuple[str, int, dict[str, dict[str, Any]], list[str]]] = [
    # degrees vs the world size
    ("degrees_exceed_world", 4, {"parallel": {"tp": 2, "pp": 4}},
     ["world size 4 is not a multiple of parallel.tp=2 x pp=4 x cp=1 = 8",
      "change the degrees or the number of ranks"]),
    ("explicit_dp_vs_world", 8, {"parallel": {"tp": 2, "dp": 2}},
     ["world size 8 != parallel.tp=2", "dp=2", "(--nproc)"]),
    # model shape vs tp
    ("heads_vs_tp", 3, {"parallel": {"tp": 3}},
     ["model.num_heads=8 is not divisible by parallel.tp=3", "choose tp dividing the head count"]),
    ("kv_heads_vs_tp", 4, {"model": {"num_kv_heads": 2}, "parallel": {"tp": 4}},
     ["model.num_kv_heads=2 is not divisible by parallel.tp=4", "use tp <= kv heads"]),
    ("ffn_vs_tp", 8, {"model": {"ffn_hidden_size": 100}, "parallel": {"tp": 8}},
     ["model.ffn_hidden_size=100 is not divisible by parallel.tp=8", "a multiple of tp"]),
    ("hidden_vs_heads", 1, {"model": {"hidden_size": 60}},
     ["model.hidden_size=60 is not divisible by model.num_heads=8", "pick a head count"]),
    ("heads_vs_kv_heads", 1, {"model": {"num_kv_heads": 3}},
     ["model.num_heads=8 is not divisible by model.num_kv_heads=3", "whole group"]),
    ("odd_rope_head_dim", 1, {"model": {"hidden_size": 72}},
     ["head dim 9", "model.hidden_size / model.num_heads", "must be even for RoPE"]),
    ("vocab_zero", 1, {"model": {"vocab_size": 0}}, ["model.vocab_size=0 must be >= 1"]),
    ("micro_batch_zero", 1, {"training": {"micro_batch_size": 0}},
     ["training.micro_batch_size=0 must be >= 1"]),
    ("seq_longer_than_positions", 1, {"training": {"seq_len": 128}},
     ["training.seq_len=128 exceeds model.max_seq_len=64", "raise max_seq_len"]),
    ("dropout_out_of_range", 1, {"model": {"hidden_dropout": 1.0}},
     ["model.hidden_dropout=1.0 must be in [0, 1)"]),
    # pipeline
    ("layers_vs_pp_vp", 2, {"model": {"num_layers": 5}, "parallel": {"pp": 2}},
     ["model.num_layers=5 is not divisible by parallel.pp x parallel.vp=2",
      "set parallel.pipeline_layout", "No layer is ever dropped"]),
    ("layout_length", 2, {"parallel": {"pp": 2, "pipeline_layout": [4]}},
     ["parallel.pipeline_layout has 1 entries", "pp x vp=2"]),
    ("layout_sum", 2, {"parallel": {"pp": 2, "pipeline_layout": [1, 2]}},
     ["parallel.pipeline_layout=[1, 2]", "sum to model.num_layers=4"]),
    ("vp_without_interleaved", 2, {"parallel": {"pp": 2, "vp": 2, "schedule": "1f1b"}},
     ["parallel.vp=2 needs parallel.schedule='interleaved_1f1b'", "or set vp=1"]),
    ("interleaved_without_vp", 2, {"parallel": {"pp": 2, "schedule": "interleaved_1f1b"}},
     ["parallel.schedule='interleaved_1f1b' needs parallel.vp >= 2"]),
    ("vp_without_pp", 1, {"parallel": {"vp": 2, "schedule": "interleaved_1f1b"}},
     ["parallel.vp > 1 needs parallel.pp > 1"]),
    ("unknown_schedule", 1, {"parallel": {"schedule": "2f2b"}},
     ["parallel.schedule='2f2b' is unknown", "use one of gpipe, 1f1b, interleaved_1f1b"]),
    # sequence parallelism and tp overlap
    ("sp_without_tp", 1, {"parallel": {"sp": True}},
     ["parallel.sp=true needs parallel.tp > 1", "set sp=false or tp >= 2"]),
    ("sp_seq_vs_tp", 4, {"parallel": {"tp": 4, "sp": True}, "training": {"seq_len": 30}},
     ["training.seq_len=30 is not divisible by parallel.tp=4", "parallel.sp=true",
      "pick a multiple of tp"]),
    ("tp_chunks_without_sp", 2, {"parallel": {"tp": 2, "tp_comm_chunks": 2}},
     ["parallel.tp_comm_chunks > 1 needs parallel.sp=true"]),
    ("context_parallel_seq", 2, {"parallel": {"cp": 2}, "training": {"seq_len": 30}},
     ["training.seq_len=30 is not divisible by 2 x parallel.cp = 4", "holds 2 of them"]),
    ("bad_rank_order", 1, {"parallel": {"order": "tp-dp-pp"}},
     ["parallel.order='tp-dp-pp' must name each axis", "e.g. 'tp-cp-dp-pp'"]),
    # the expert view: ep x expert_tp folded inside tp x cp x dp of a stage
    ("ep_x_expert_tp_vs_stage", 4, {"parallel": {"tp": 2, "ep": 3}},
     ["parallel.ep=3 x parallel.expert_tp=2 (= tp) = 6 does not divide parallel.tp=2 x cp=1 x "
      "dp=2 = 4", "choose ep and expert_tp whose product divides 4, e.g. ep in [1, 2]"]),
    ("expert_tp_vs_stage", 2, {"parallel": {"expert_tp": 4}},
     ["parallel.ep=1 x parallel.expert_tp=4 = 4 does not divide", "lower expert_tp"]),
    ("ep_without_experts", 2, {"parallel": {"ep": 2, "expert_tp": 1}},
     ["parallel.ep=2 needs a mixture-of-experts model", "set ep=1"]),
    ("expert_tp_positive", 1, {"parallel": {"expert_tp": 0}},
     ["parallel.expert_tp=0 must be >= 1"]),
    ("order_names_ep_with_ep", 2, {"parallel": {"ep": 2, "order": "tp-cp-ep-dp-pp"}},
     ["parallel.order='tp-cp-ep-dp-pp' names ep", "drop 'ep' from the order, e.g. "
      "'tp-cp-dp-pp'"]),
    ("nccl_on_cpu", 1, {"parallel": {"backend": "nccl"}},
     ["parallel.backend='nccl' needs GPUs", "use 'gloo'"]),
    # batch arithmetic
    ("global_vs_micro_dp", 2, {"training": {"global_batch_size": 6, "micro_batch_size": 4}},
     ["training.global_batch_size=6 is not divisible by training.micro_batch_size x dp=8",
      "make it a multiple"]),
    ("global_vs_microbatches", 1, {"training": {"global_batch_size": 16, "microbatches": 3}},
     ["training.global_batch_size=16 != micro_batch_size x microbatches x dp=6",
      "set only one of them"]),
    # files
    ("missing_data_input", 1, {"data": {"input": MISSING}},
     [f"data.input='{MISSING}' does not exist", "leave it unset for the built-in corpus"]),
    ("missing_tokenizer", 1, {"data": {"tokenizer": f"{MISSING}/tokenizer.json"}},
     ["data.tokenizer=", "does not exist", "unset it to train one"]),
    ("malformed_blend_entry", 1, {"data": {"blend": ["abc"]}},
     ["data.blend entry 'abc' must look like 'weight:path/prefix'"]),
    ("missing_blend_files", 1, {"data": {"blend": [f"1.0:{MISSING}/data"]}},
     [f"{MISSING}/data.bin and {MISSING}/data.idx missing", "run `colonnade prepare`"]),
    ("missing_checkpoint_load", 1, {"checkpoint": {"load": f"{MISSING}/ckpt"}},
     [f"checkpoint.load='{MISSING}/ckpt' does not exist", "unset it to start fresh"]),
    ("interval_without_save", 1, {"checkpoint": {"interval": 5, "save": "none"}},
     ["checkpoint.interval > 0 needs checkpoint.save=DIR or 'auto'"]),
    ("empty_save", 1, {"checkpoint": {"save": ""}},
     ["checkpoint.save is empty", "'none' to save nothing"]),
    # optimizer and numerics
    ("unknown_precision", 1, {"training": {"precision": "fp8"}},
     ["training.precision='fp8' is unknown", "use one of fp32, bf16, fp16, fp64"]),
    ("unknown_on_nan", 1, {"training": {"on_nan": "ignore"}},
     ["training.on_nan='ignore' is unknown", "use one of stop, skip"]),
    ("min_lr_above_lr", 1, {"optim": {"lr": 1e-3, "min_lr": 1e-2}},
     ["optim.min_lr=0.01 must be in [0, optim.lr=0.001]"]),
    # reliability and the loop
    ("timeout_not_positive", 1, {"parallel": {"timeout_s": 0}},
     ["parallel.timeout_s=0.0 must be > 0", "e.g. 300"]),
    ("watchdog_negative", 1, {"parallel": {"watchdog_s": -1}},
     ["parallel.watchdog_s=-1.0 must be >= 0", "0 disables the hang detector"]),
    ("watchdog_not_before_timeout", 1, {"parallel": {"timeout_s": 10, "watchdog_s": 10}},
     ["parallel.watchdog_s=10.0 must be < parallel.timeout_s=10.0", "0.8 x timeout_s"]),
    ("eval_without_valid_split", 1, {"training": {"eval_interval": 10},
                                     "data": {"valid_fraction": 0.0}},
     ["training.eval_interval=10 needs data.valid_fraction > 0",
      "set --training.eval_interval=0 to train without evaluation"]),
    ("log_interval_zero", 1, {"logging": {"log_interval": 0}},
     ["logging.log_interval=0 must be >= 1"]),
]


def _config(overrides: dict[str, dict[str, Any]]) -> Any:
    data = copy.deepcopy(BASE)
    for section, values in overrides.items():
        data.setdefault(section, {}).update(values)
    return config_from_dict(data)


def test_table_is_large_and_ids_unique() -> None:
    ids = [row[0] for row in TABLE]
    assert len(ids) >= 25 and len(set(ids)) == len(ids)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_base_config_is_valid(world: int) -> None:
    """Each row's failure comes from its overrides, not from the base."""
    validate(resolve(_config({}), world), world)


@pytest.mark.parametrize(("name", "world", "overrides", "expected"), TABLE,
                         ids=[row[0] for row in TABLE])
def test_invalid_config_is_rejected(name: str, world: int,
                                    overrides: dict[str, dict[str, Any]],
                                    expected: list[str]) -> None:
    config = _config(overrides)
    with pytest.raises(ConfigError) as info:
        validate(resolve(config, world), world)
    message = str(info.value)
    for part in expected:
        assert part in message, f"{name}: {part!r} not in:\n{message}"
    assert not dist.is_initialized()


def test_cli_rejects_before_launching(monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`colonnade train --nproc 4` with tp=3: exit 2, every problem listed, no rank started."""
    import colonnade.launch
    from colonnade.cli import main

    def no_launch(*_a: Any, **_k: Any) -> int:
        raise AssertionError("launch() must not be reached with an invalid config")

    monkeypatch.setattr(colonnade.launch, "launch", no_launch)
    status = main(["train", "--nproc", "4", "--parallel.tp=3", "--model.num_heads=8",
                   "--training.seq_len=4096"])
    err = capsys.readouterr().err
    assert status == 2
    assert "world size 4 is not a multiple of parallel.tp=3" in err
    assert "model.num_heads=8 is not divisible by parallel.tp=3" in err
    assert "training.seq_len=4096 exceeds model.max_seq_len" in err
    assert not dist.is_initialized()


def test_torchrun_entry_rejects_before_process_group(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    """`torchrun -m colonnade.train` path: each rank exits 2 before init_process_group."""
    from colonnade.train import main

    for key, value in {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as info:
        main(["--parallel.pp=3", "--model.num_layers=4"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "world size 4 is not a multiple of parallel.tp=1 x pp=3" in err
    assert "model.num_layers=4 is not divisible by parallel.pp x parallel.vp=3" in err
    assert not dist.is_initialized()
