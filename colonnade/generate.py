"""Sampling text from an exported model: KV cache, temperature, top-k, top-p, on CPU or a GPU.

Generation is one process: the model is rebuilt at every degree 1 (tp, pp, dp and cp: a
checkpoint trained with context parallelism generates at cp = 1, its KV cache over the whole
sequence), whatever layout wrote the checkpoint.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from colonnade.config.choices import DEVICES
from colonnade.device import has_gpu, pick_device
from colonnade.models.gpt import ModelChunk

"""``colonnade generate --device``: auto = cuda when a GPU is visible, else cpu."""


def generation_device_type(choice: str, gpu_visible: bool) -> str:
    """'cpu' or 'cuda' for ``--device choice`` given whether a GPU is visible.

    auto -> cuda when ``gpu_visible`` else cpu; cpu -> cpu; cuda -> cuda, or a ConfigError
    naming the fix when no GPU is visible (nothing is loaded first).
    """
    from colonnade.config.load import ConfigError

    if choice not in DEVICES:
        raise ConfigError(f"--device={choice!r} is not one of {DEVICES}")
    if choice == "auto":
        return "cuda" if gpu_visible else "cpu"
    if choice == "cuda" and not gpu_visible:
        raise ConfigError("--device=cuda but no CUDA device is visible here; use --device=cpu "
                          "(or auto, which falls back to the CPU)")
    return choice


def generation_device(choice: str = "auto") -> torch.device:
    """The device ``colonnade generate --device choice`` runs on (see
    :func:`generation_device_type`); cuda is this process's first visible GPU."""
    return pick_device(generation_device_type(choice, has_gpu()))


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Keep the top-k logits and the smallest set whose probability reaches top_p ([b, V])."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # mass before a token already reaches p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


@torch.no_grad()
def sampling_problems(max_new_tokens: int, temperature: float, top_k: int, top_p: float
                      ) -> list[str]:
    """What is wrong with generation arguments, each naming the option and its range (none:
    an empty list); ``colonnade generate`` refuses them before loading the model."""
    out = []
    if max_new_tokens < 0:
        out.append(f"--max-new-tokens={max_new_tokens} must be >= 0")
    if not math.isfinite(temperature) or temperature < 0:
        out.append(f"--temperature={temperature} must be >= 0 (0: greedy)")
    if top_k < 0:
        out.append(f"--top-k={top_k} must be >= 0 (0: off)")
    if not 0 < top_p <= 1:
        out.append(f"--top-p={top_p} must be in (0, 1] (1: off)")
    return out


def generate(model: ModelChunk, prompt: torch.Tensor, max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             use_cache: bool = True, generator: torch.Generator | None = None,
             eod: int | None = None) -> torch.Tensor:
    """Extend prompt [b, s0] by up to ``max_new_tokens``; temperature 0 means greedy.

    With ``use_cache`` each new token runs one position through the layers against cached keys
    and values; without it the whole sequence is recomputed every step (same result).
    The prompt is moved to the model's device; the result [b, s0 + new] stays there. A
    ``generator`` for sampling must be on that device too. Generation stops at the model's
    context, ``max_seq_len`` tokens in all; a prompt must leave room for one.
    """
    limit = model.cfg.max_seq_len
    if prompt.ndim != 2 or not 0 < prompt.shape[1] < limit:
        raise ValueError(f"prompt must be [batch, tokens] with 1 to {limit - 1} tokens (the "
                         f"model's context, max_seq_len, is {limit}), got shape "
                         f"{tuple(prompt.shape)} (an empty text prompt: start from the "
                         "end-of-document token)")
    problems = sampling_problems(max_new_tokens, temperature, top_k, top_p)
    if problems:
        raise ValueError("; ".join(problems))
    model.eval()
    prompt = prompt.to(next(model.parameters()).device)
    if prompt.shape[1] + max_new_tokens > limit:
        max_new_tokens = max(0, limit - prompt.shape[1])
    tokens = prompt
    caches = model.new_caches(prompt.shape[0], limit) if use_cache else None
    pending = prompt
    for _ in range(max_new_tokens):
        logits = model.full_logits(pending if use_cache else tokens, caches)[:, -1]  # [b, V]
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            probs = filter_logits(logits.float() / temperature, top_k, top_p).softmax(-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
        tokens = torch.cat([tokens, nxt], dim=1)
        pending = nxt
        if eod is not None and bool((nxt == eod).all()):
            break
    return tokens


MODEL_DIR_KINDS = (
    "a Hugging Face Llama/GPT-2 folder (config.json naming its architecture, model*.safetensors, "
    "tokenizer.json), a Colonnade checkpoint (train --checkpoint.save=DIR: its root with a "
    "`latest` marker, or a step_N dir with index.json and tokenizer.json; or convert --from-hf "
    "output), or a run's logging.dir (its checkpoints/, or the checkpoint.save its config.toml "
    "names)")


def load_for_generation(directory: str | Path, device: torch.device | None = None
                        ) -> tuple[ModelChunk, Path]:
    """The single-process model (moved to ``device``; None keeps it on the CPU) and the
    tokenizer.json of a model directory (see :data:`MODEL_DIR_KINDS`); a clear error naming
    what such a directory holds otherwise."""
    model, tokenizer = _load_on_cpu(directory)
    return (model if device is None else model.to(device)), tokenizer


def _load_on_cpu(directory: str | Path) -> tuple[ModelChunk, Path]:
    from colonnade.checkpoint.commit import resolve_checkpoint, run_save_dir
    from colonnade.checkpoint.export import load_exported, load_full_state
    from colonnade.checkpoint.format import CheckpointError
    from colonnade.checkpoint.hf import is_hf_dir, read_hf
    from colonnade.config.sections import Config
    from colonnade.models.build import build_reference

    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such directory; give {MODEL_DIR_KINDS}")
    if is_hf_dir(path):
        model_cfg, state = read_hf(path)
        model = build_reference(Config(model=model_cfg))
        load_full_state(model, state)
        return model, _tokenizer_in(path, path)
    if (path / "latest").exists() or (path / "index.json").exists():
        _config, model = load_exported(path)
        return model, _tokenizer_in(resolve_checkpoint(path), path)
    if (path / "config.toml").is_file():  # a run's logging.dir
        try:
            save = run_save_dir(path)
        except CheckpointError as err:
            raise CheckpointError(f"{err}; give {MODEL_DIR_KINDS}") from None
        return _load_on_cpu(save)
    raise FileNotFoundError(f"{path} is not a model directory: give {MODEL_DIR_KINDS}")


def _tokenizer_in(*candidates: Path) -> Path:
    for directory in candidates:
        if (directory / "tokenizer.json").is_file():
            return directory / "tokenizer.json"
    raise FileNotFoundError(f"{candidates[0]}: no tokenizer.json, so the prompt cannot be "
                            "encoded; copy the data's tokenizer.json (data.prepared_dir) there")
