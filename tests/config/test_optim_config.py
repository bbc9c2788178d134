"""optim.state_dtype / optim.master_dtype against training.precision: refused combinations
name the fields and the fix; accepted ones validate."""

from __future__ import annotations

import dataclasses

import pytest

from colonnade.config.load import ConfigError
from colonnade.config.sections import Config
from colonnade.config.validate import problems, validate


def _config(precision: str, state: str, master: str) -> Config:
    cfg = Config()
    return dataclasses.replace(
        cfg, training=dataclasses.replace(cfg.training, precision=precision),
        optim=dataclasses.replace(cfg.optim, state_dtype=state, master_dtype=master))


@pytest.mark.parametrize(("precision", "state", "master", "refused"), [
    ("bf16", "bf16", "bf16", None), ("bf16", "bf16", "fp32", None), ("fp32", "bf16", "fp32", None),
    ("fp16", "bf16", "fp32", None),
    ("fp32", "fp32", "bf16", "optim.master_dtype='bf16' needs training.precision='bf16'"),
    ("fp16", "fp32", "bf16", "optim.master_dtype='bf16' needs training.precision='bf16'"),
    ("fp64", "bf16", "fp32", "optim.state_dtype='bf16' with training.precision='fp64'"),
])
def test_precision_aware_states_rules(precision: str, state: str, master: str,
                                      refused: str | None) -> None:
    found = [m for m in problems(_config(precision, state, master)) if "optim." in m]
    if refused is None:
        assert found == []
        return
    assert len(found) == 1 and refused in found[0] and "set optim." in found[0], found
    with pytest.raises(ConfigError, match="optim"):
        validate(_config(precision, state, master))
