"""Generation: KV-cache decoding equals full recomputation; top-k / top-p filtering; sampling."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from colonnade.config import Config, load_config
from colonnade.generate import filter_logits, generate
from colonnade.models.build import build_reference

ARCHS = {
    "llama": ["--model.arch=llama", "--model.num_kv_heads=2"],
    "gpt2": ["--model.arch=gpt2", "--model.tie_embeddings=true", "--model.bias=true"],
}


def tiny(arch: str) -> Config:
    # a large init_std makes the logits far from uniform, so greedy paths are non-trivial
    return load_config(None, [*ARCHS[arch], "--model.hidden_size=32", "--model.num_layers=2",
                              "--model.num_heads=4", "--model.vocab_size=97",
                              "--model.max_seq_len=40", "--model.init_std=0.2"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_kv_cache_greedy_matches_recompute(arch: str, dtype: torch.dtype) -> None:
    model = build_reference(tiny(arch), dtype)
    prompt = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(2))
    cached = generate(model, prompt, 20, temperature=0.0, use_cache=True)
    full = generate(model, prompt, 20, temperature=0.0, use_cache=False)
    assert cached.shape == (3, 25)
    assert torch.equal(cached, full)
    assert torch.equal(cached[:, :5], prompt)
    assert len(set(cached[0, 5:].tolist())) > 2  # not a degenerate constant output


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_cached_logits_match_full_forward(arch: str) -> None:
    model = build_reference(tiny(arch), torch.float64).eval()
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    full = model.full_logits(tokens)  # [b, s, V]
    caches = model.new_caches(2, 40)
    parts = [model.full_logits(tokens[:, :4], caches)]  # prompt in one go
    parts += [model.full_logits(tokens[:, i:i + 1], caches) for i in range(4, 9)]  # one by one
    assert caches[0].length == 9
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-10, atol=1e-12)


def test_generation_stops_at_max_seq_len_and_eod() -> None:
    model = build_reference(tiny("llama"))
    prompt = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(4))
    out = generate(model, prompt, 100, temperature=0.0)
    assert out.shape == (1, 40)  # model.max_seq_len
    first = int(generate(model, prompt[:, :3], 1, temperature=0.0)[0, -1])
    stopped = generate(model, prompt[:, :3], 10, temperature=0.0, eod=first)
    assert stopped.shape == (1, 4) and int(stopped[0, -1]) == first


def test_sampling_is_seeded_and_respects_top_k() -> None:
    model = build_reference(tiny("gpt2"))
    prompt = torch.randint(0, 97, (4, 3), generator=torch.Generator().manual_seed(5))

    def sample(seed: int, **kw: float) -> torch.Tensor:
        return generate(model, prompt, 12, temperature=1.0,
                        generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(sample(1), sample(1))
    assert not torch.equal(sample(1), sample(2))
    # top_k=1 is greedy whatever the temperature
    assert torch.equal(sample(3, top_k=1), generate(model, prompt, 12, temperature=0.0))
    assert torch.equal(sample(4, top_p=1e-6), generate(model, prompt, 12, temperature=0.0))


def test_filter_top_k() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [0.0, -1.0, 2.0, 1.0, 3.0]])
    out = filter_logits(logits, top_k=2)
    inf = float("-inf")
    torch.testing.assert_close(out, torch.tensor([[inf, 5.0, inf, 4.0, inf],
                                                  [inf, inf, 2.0, inf, 3.0]]))
    torch.testing.assert_close(filter_logits(logits, top_k=0), logits)
    torch.testing.assert_close(filter_logits(logits, top_k=99), logits)


def test_filter_top_p() -> None:
    probs = torch.tensor([[0.5, 0.05, 0.25, 0.2]], dtype=torch.float64)
    logits = probs.log()
    inf = float("-inf")
    # sorted: 0.5, 0.25, 0.2, 0.05; mass before each: 0, 0.5, 0.75, 0.95. The kept set is the
    # smallest prefix whose mass reaches top_p (0.5 alone reaches 0.5).
    keep = {1e-9: [0], 0.4: [0], 0.5: [0], 0.6: [0, 2], 0.7: [0, 2], 0.8: [0, 2, 3],
            0.99: [0, 1, 2, 3]}
    for top_p, kept in keep.items():
        out = filter_logits(logits, top_p=top_p)
        expect = torch.full_like(logits, inf)
        expect[0, kept] = logits[0, kept]
        torch.testing.assert_close(out, expect, msg=f"top_p={top_p}")
        renorm = out.softmax(-1)
        assert math.isclose(float(renorm.sum()), 1.0, rel_tol=1e-6)
    both = filter_logits(logits, top_k=1, top_p=0.99)
    assert torch.isfinite(both).sum() == 1 and torch.isfinite(both[0, 0])


def test_generation_device_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """`generate --device`: auto follows GPU visibility; cuda without a GPU is a clear error."""
    from colonnade import generate as gen_mod
    from colonnade.config.load import ConfigError
    from colonnade.generate import generation_device, generation_device_type

    assert generation_device_type("auto", gpu_visible=True) == "cuda"
    assert generation_device_type("auto", gpu_visible=False) == "cpu"
    assert generation_device_type("cpu", gpu_visible=True) == "cpu"
    assert generation_device_type("cuda", gpu_visible=True) == "cuda"
    with pytest.raises(ConfigError, match="--device=cuda but no CUDA device"):
        generation_device_type("cuda", gpu_visible=False)
    with pytest.raises(ConfigError, match="not one of"):
        generation_device_type("tpu", gpu_visible=True)
    monkeypatch.setattr(gen_mod, "has_gpu", lambda: False)
    assert generation_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError):
        generation_device("cuda")


def test_generate_cli_device_cpu_output_unchanged(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`colonnade generate --device cpu` prints what the CPU-only code printed: the same
    tokens as loading on the CPU and sampling with a CPU generator (greedy and seeded)."""
    from colonnade import generate as gen_mod
    from colonnade.cli import main
    from colonnade.data.tokenizer import load_tokenizer
    from colonnade.generate import load_for_generation
    from tests.gpu.helpers import tiny_checkpoint

    monkeypatch.setattr(gen_mod, "has_gpu", lambda: False)  # auto = cpu on any machine
    ck = tiny_checkpoint(tmp_path)
    model, tok_path = load_for_generation(ck)
    tok = load_tokenizer(tok_path)
    prompt = torch.tensor([tok.encode("def foo", add_special_tokens=False).ids])
    for temp, seed in ((0.0, 0), (1.0, 7)):
        out = generate(model, prompt, 10, temperature=temp, top_k=40, top_p=0.95,
                       generator=torch.Generator().manual_seed(seed))
        expect = tok.decode(out[0].tolist()) + "\n"
        args = ["generate", str(ck), "--prompt", "def foo", "--max-new-tokens", "10",
                "--temperature", str(temp), "--seed", str(seed)]
        for device in ([], ["--device", "cpu"]):
            assert main([*args, *device]) == 0
            assert capsys.readouterr().out == expect, (temp, device)


def test_an_empty_prompt_starts_a_new_document(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`--prompt ""` (an IndexError traceback before) continues the end-of-document token:
    the model's own start of a document; generate() itself refuses an empty prompt by name."""
    from colonnade import generate as gen_mod
    from colonnade.cli import main
    from colonnade.data.tokenizer import eod_id, load_tokenizer
    from colonnade.generate import load_for_generation
    from tests.gpu.helpers import tiny_checkpoint

    monkeypatch.setattr(gen_mod, "has_gpu", lambda: False)
    ck = tiny_checkpoint(tmp_path)
    model, tok_path = load_for_generation(ck)
    tok = load_tokenizer(tok_path)
    out = generate(model, torch.tensor([[eod_id(tok)]]), 10, temperature=0.0)
    assert main(["generate", str(ck), "--prompt", "", "--max-new-tokens", "10",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out == tok.decode(out[0].tolist()) + "\n"
    with pytest.raises(ValueError, match=r"with 1 to \d+ tokens"):
        generate(model, torch.zeros((1, 0), dtype=torch.long), 3)


def test_generation_arguments_are_checked_before_loading(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad sampling options are refused by name before the model loads (a negative temperature
    silently meant greedy, top-p > 1 no filtering, a negative count no tokens); a prompt that
    fills the context is refused with its length; one that leaves less room than asked for
    generates what fits and says so."""
    from colonnade import generate as gen_mod
    from colonnade.cli import main
    from colonnade.generate import load_for_generation
    from tests.gpu.helpers import tiny_checkpoint

    monkeypatch.setattr(gen_mod, "has_gpu", lambda: False)
    assert main(["generate", str(tmp_path / "absent"), "--temperature", "-1", "--top-p", "2",
                 "--top-k", "-1", "--max-new-tokens", "-3"]) == 2
    err = capsys.readouterr().err
    for part in ("--max-new-tokens=-3 must be >= 0", "--temperature=-1.0 must be >= 0",
                 "--top-k=-1 must be >= 0", "--top-p=2.0 must be in (0, 1]"):
        assert part in err, err
    assert "absent" not in err  # refused before the model directory was looked at
    ck = tiny_checkpoint(tmp_path)
    model, _ = load_for_generation(ck)
    limit = model.cfg.max_seq_len
    with pytest.raises(ValueError, match="--top-p=0 must be in"):
        generate(model, torch.ones((1, 2), dtype=torch.long), 3, top_p=0)
    assert main(["generate", str(ck), "--prompt", "a" * 4 * limit]) == 2
    assert "the model's context (max_seq_len) is" in capsys.readouterr().err
    assert main(["generate", str(ck), "--prompt", "def", "--max-new-tokens", str(10 * limit),
                 "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert f" tokens, not {10 * limit}: the prompt's " in err and f"context ({limit})" in err
