"""Model presets (issue 14, item 15): GPT-2 124M / 350M and Llama 3 8B / 70B have the real
shapes (parameter counts from the planner's counter equal transformers' and the published ones),
and `colonnade train --print-config` and `colonnade plan` accept them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from colonnade.analysis.cli import configs_dir, model_presets
from colonnade.checkpoint.hf import hf_config_from_model
from colonnade.cli import main
from colonnade.config.load import load_config
from colonnade.models.counts import LayerShape, total_params

PRESETS = {  # name: (published size, exact count of the HF model of that name)
    "gpt2-124m": (124e6, 124_439_808),
    "gpt2-350m": (355e6, 354_823_168),
    "llama3-8b": (8.03e9, 8_030_261_248),
    "llama3-70b": (70.6e9, 70_553_706_496),
}


def _path(name: str) -> Path:
    return configs_dir() / f"{name}.toml"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_parameter_count(name: str) -> None:
    published, exact = PRESETS[name]
    model = load_config(_path(name)).model
    count = total_params(LayerShape.of(model))
    assert abs(count - published) / published < 0.01, (name, count)
    assert count == exact
    hf = hf_config_from_model(model)  # the same shape counted by transformers, on meta
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items()
                                               if k != "architectures"})
    with torch.device("meta"):
        assert transformers.AutoModelForCausalLM.from_config(cfg).num_parameters() == exact


def test_llama3_shapes() -> None:
    for name, layers, hidden, heads, ffn in (("llama3-8b", 32, 4096, 32, 14336),
                                             ("llama3-70b", 80, 8192, 64, 28672)):
        m = load_config(_path(name)).model
        assert (m.num_layers, m.hidden_size, m.num_heads, m.kv_heads, m.ffn_size) == (
            layers, hidden, heads, 8, ffn)
        assert (m.vocab_size, m.rope_theta, m.norm_eps, m.max_seq_len) == (
            128256, 500000.0, 1e-5, 8192)
        assert not m.tie_embeddings and m.arch == "llama"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_cli_accepts_presets(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert name in model_presets()
    assert main(["train", "--config", str(_path(name)), "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert f"vocab_size = {load_config(_path(name)).model.vocab_size}" in printed
    assert main(["plan", "--model", name, "--cluster", "h200", "--gpus", "64", "--top", "1"]) \
        == 0
    assert f"({PRESETS[name][1] / 1e9:.2f}B params)" in capsys.readouterr().out
