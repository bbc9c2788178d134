"""What a Hugging Face folder may hold that Colonnade cannot run is refused in one line with
exit 2 by every command that reads one (`convert --from-hf`, `generate`, `train --init-from`),
never with a traceback; the help texts name every class Colonnade reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from colonnade.checkpoint.hf_moe import ALL_FORMATS
from colonnade.cli import main

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
         "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-5, "rope_theta": 500.0, "tie_word_embeddings": False}
"""A tiny Llama config.json (the tests change one thing in it)."""


def _hf_dir(path: Path, **changes: Any) -> Path:
    """A folder with ``LLAMA`` + ``changes`` as config.json and a (tiny) model.safetensors."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**LLAMA, **changes}))
    save_file({"model.norm.weight": torch.ones(32)}, str(path / "model.safetensors"))
    return path


CASES = {
    "class": ({"architectures": ["GPTNeoXForCausalLM"]},
              "architecture 'GPTNeoXForCausalLM' is not supported"),
    "rope_type": ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
                  "'longrope'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_command_refuses_an_hf_folder_it_cannot_run_with_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    changes, message = CASES[case]
    hf = _hf_dir(tmp_path / "hf", **changes)
    commands = {"convert": ["convert", "--from-hf", str(hf), "--out", str(tmp_path / "ck")],
                "generate": ["generate", str(hf), "--device=cpu"],
                "train": ["train", "--init-from", str(hf), "--dry-run"]}
    for name, argv in commands.items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, f"{name}: {err}"
        assert str(hf) in err, f"{name} does not name the folder: {err}"
    assert not (tmp_path / "ck").exists()


def test_help_texts_name_every_hf_class(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("generate", "convert", "train"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for fmt in ALL_FORMATS.values():
            assert fmt.hf_class in text, f"`{command} --help` does not name {fmt.hf_class}"
        assert "Llama/GPT-2" not in text
