"""The Hugging Face twin of a fuzz case: the same model in ``transformers``, trained by
``torch.optim.AdamW``, against Colonnade's single-process run (:mod:`colonnade.fuzz.run`).

The case's initial weights are exported as an HF folder (``write_hf``, what ``colonnade
convert --to-hf`` writes), loaded by ``AutoModelForCausalLM.from_pretrained`` and made float64
with transformers' float32 islands removed (:func:`float64_twin`, :class:`float64_softmax`).
Each step: every micro-batch's ``F.cross_entropy`` of HF's logits against the (shifted) labels,
summed over micro-batches / their count, backward; the gradients clipped to ``optim.clip_grad``
by their global norm; AdamW with Colonnade's decay rule (matrices decay, vectors do not) at
``lr_at(step)``. Per step the loss and every gradient, after the last step every parameter,
under HF's file-layout names; the single-process run's tensors are mapped there by the
family's own ``to_hf`` (linear in the tensors, so it maps gradients too).

A case has a twin when its model has an HF class and nothing outside transformers' model:
float64, no dropout (HF draws its masks from torch's generator), no document resets, no label
smoothing, no multi-token prediction, and for MoE dropless routing without auxiliary losses
and without the sigmoid router's bias updates (:func:`twin_gap`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from colonnade.config.sections import Config, ModelConfig
from colonnade.pipeline.plan import Batch


def twin_gap(config: Config, eod: int | None) -> str:
    """Why the case has no HF twin ('' when it has one)."""
    m, t = config.model, config.training
    reasons = [(t.precision != "fp64", f"precision {t.precision}"),
               (config.optim.name != "adamw", f"optim.name={config.optim.name} (the twin "
                "trains with torch.optim.AdamW)"),
               (m.hidden_dropout > 0 or m.attention_dropout > 0, "dropout"),
               (eod is not None, "document resets"),
               (t.label_smoothing > 0, "label smoothing"),
               (config.optim.qk_clip_threshold > 0, "q/k logit clipping"),
               (m.mtp_layers > 0, "multi-token prediction"),
               (m.moe and m.moe_capacity_factor is not None, "expert capacity"),
               (m.moe and (m.moe_aux_loss_coeff > 0 or m.moe_z_loss_coeff > 0), "aux losses"),
               (m.moe and m.moe_router == "sigmoid" and m.moe_router_bias_update_rate > 0,
                "router bias updates")]
    found = [why for gap, why in reasons if gap]
    if found:
        return ", ".join(found)
    from colonnade.checkpoint.hf import hf_config_from_model

    try:
        hf_config_from_model(m)
    except ValueError as err:
        return f"no HF class: {err}"
    return ""


def hf_twin(config: Config, initial: dict[str, torch.Tensor],
            steps: list[list[Batch]]) -> dict[str, Any]:
    """Train the HF twin of ``config`` from the full tensors ``initial`` on ``steps`` (each
    step's micro-batches). Returns per step the loss and the gradients, and the parameters
    after the last step (float64, HF file-layout names); or ``{"gap": why}`` when
    transformers refuses the exported config (e.g. hidden size not a multiple of the heads
    with an explicit head_dim, which Colonnade runs)."""
    import transformers
    from huggingface_hub.errors import StrictDataclassError

    from colonnade.hf_export import write_hf

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()  # its "Loading weights" bar, per case
    with tempfile.TemporaryDirectory() as tmp:
        write_hf(Path(tmp), config.model, initial)
        try:
            hf_config = transformers.AutoConfig.from_pretrained(tmp)
        except (ValueError, StrictDataclassError) as err:  # a shape transformers refuses
            return {"gap": f"transformers refuses the config: {' '.join(str(err).split())}"}
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp, config=hf_config,
                                                                   dtype=torch.float64)
    # train() before the float64 patches, never after: transformers' train() re-installs
    # its own RMSNorm forward (a float32 island, ~1e-7) over an instance's patched one
    model = float64_twin(loaded.train(), config.model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # Colonnade's decay rule (optim.adamw.decays) on transformers' names: gpt-oss's stacked
    # expert biases [E, f] are 2-D but biases
    decayed = [p for n, p in named if p.ndim > 1 and not n.endswith("bias")]
    plain = [p for n, p in named if p.ndim <= 1 or n.endswith("bias")]
    params = [p for _, p in named]
    o = config.optim
    opt = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": o.weight_decay},
         {"params": plain, "weight_decay": 0.0}],
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    vocab = config.model.vocab
    losses, grads = [], []
    for step, batches in enumerate(steps):
        opt.zero_grad()
        total = 0.0
        for tokens, labels in batches:
            with float64_softmax():
                logits = model(tokens).logits  # [b, s, V]
            loss = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
            (loss / len(batches)).backward()
            total += float(loss.detach())
        losses.append(total / len(batches))
        grads.append({k: v.detach().clone() for k, v in file_layout_grads(model).items()})
        reference_update(params, opt, config, step)
    return {"losses": losses, "grads": grads, "params": file_layout_params(model)}


def file_layout_params(model: Any) -> dict[str, torch.Tensor]:
    """The parameters of an HF ``model`` under the names and shapes of its saved files."""
    from transformers.core_model_loading import revert_weight_conversion

    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(revert_weight_conversion(model, state))


def to_file_layout(cfg: ModelConfig, tensors: dict[str, torch.Tensor],
                   like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Colonnade's full tensors (parameters or gradients) under HF's file-layout names, by
    the family's ``to_hf``; a tensor of ``like`` (the parameters) missing from ``tensors``
    (a frozen parameter's gradient) counts as zeros."""
    from colonnade.checkpoint.hf import to_hf_state

    return to_hf_state(cfg, {**{k: torch.zeros_like(v) for k, v in like.items()}, **tensors})


def file_layout_grads(model: Any) -> dict[str, torch.Tensor]:
    """The gradients of an HF ``model`` under the names and shapes of its saved files:
    transformers >= 5 fuses some weights in memory (MoE experts: ``experts.gate_up_proj``
    [E, 2f, h]) and splits them back on save; the same (linear) conversion applied to the
    gradients gives the per-expert tensors our ``to_hf`` names."""
    from transformers.core_model_loading import revert_weight_conversion

    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return dict(revert_weight_conversion(model, grads))


def float64_twin(model: Any, cfg: ModelConfig) -> Any:
    """A float64 copy of an HF model with its float32 islands removed (the reference of
    every check): transformers computes the RMSNorm (``.to(torch.float32)``), the RoPE
    cos/sin tables and the routers' and eager attention's softmax in float32 whatever the
    model's dtype. Here every ``*RMSNorm`` runs the same formula in float64, the rotary
    module returns HF's [b, s, d] tables built from Colonnade's float64 angles (whose init is
    checked against transformers' own rope init separately, at float32 precision), and
    softmax keeps float64 (:func:`float64_softmax`, entered by the caller). MoE classes run
    their eager experts (transformers' grouped_mm kernel takes no float64)."""
    import copy

    from colonnade.models.blocks import rope_tables

    out = copy.deepcopy(model).double()
    if out._can_set_experts_implementation():  # MoE: its default grouped_mm has no float64
        out.set_experts_implementation("eager")
    for module in out.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = rms_norm_fp64.__get__(module)
    rotary = getattr(getattr(out, "model", None), "rotary_emb", None)  # GPT-2: none
    if rotary is not None:
        cos, sin = rope_tables(cfg, None, torch.float64)  # [S, d/2]
        x = torch.zeros(1, dtype=torch.float64)
        width = rotary(x, torch.zeros(1, 1, dtype=torch.long))[0].shape[-1]  # d, or d/2
        rotary.forward = Float64Rope(cos, sin, half=width == cos.shape[-1]).forward
    return out


def rms_norm_fp64(self: Any, x: torch.Tensor) -> torch.Tensor:
    """HF's RMSNorm formula without its cast to float32."""
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", None))
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class Float64Rope:
    """HF's rotary module's outputs, cos and sin [b, s, d] (the d/2 angles twice, as HF's
    ``cat((freqs, freqs))``), taken from float64 tables [S, d/2] by ``position_ids``;
    ``half``: [b, s, d/2] once (gpt-oss's rotary module returns the angles once)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, half: bool = False) -> None:
        if not half:
            cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # [S, d]
        self.cos, self.sin = cos, sin

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[position_ids].to(x.dtype), self.sin[position_ids].to(x.dtype)


class float64_softmax:  # a context manager used like a function
    """Inside: ``softmax(x, dim, dtype=torch.float32)`` of a float64 ``x`` stays float64
    (transformers' routers and eager attention ask for float32), and so does
    ``x.type(torch.float32)`` (DeepSeek-V3's router casts its input and weight so) and
    ``x.float()`` (Mixtral's router: ``softmax(router_logits.float())``)."""

    def __enter__(self) -> None:
        self.saved = F.softmax, torch.softmax, torch.Tensor.softmax
        self.saved_type = torch.Tensor.type
        saved_type = self.saved_type

        def keep_type(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if x.dtype == torch.float64 and args[:1] == (torch.float32,) and not kwargs:
                return x
            return saved_type(x, *args, **kwargs)

        torch.Tensor.type = keep_type  # type: ignore[method-assign,assignment]
        self.saved_float = torch.Tensor.float
        saved_float = self.saved_float

        def keep_float(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return x if x.dtype == torch.float64 else saved_float(x, *args, **kwargs)

        torch.Tensor.float = keep_float  # type: ignore[method-assign,assignment]

        def keep(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            def call(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
                if x.dtype == torch.float64 and kwargs.get("dtype") == torch.float32:
                    kwargs["dtype"] = torch.float64
                return fn(x, *args, **kwargs)
            return call

        F.softmax, torch.softmax = keep(F.softmax), keep(torch.softmax)
        torch.Tensor.softmax = keep(torch.Tensor.softmax)

    def __exit__(self, *exc: object) -> None:
        F.softmax, torch.softmax, torch.Tensor.softmax = self.saved
        torch.Tensor.type = self.saved_type  # type: ignore[method-assign]
        torch.Tensor.float = self.saved_float  # type: ignore[method-assign]


def reference_update(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer,
                     config: Config, step: int) -> torch.Tensor:
    """A single-process reference's update after its backward (the transformers twin's and
    the tests' float64 references'): clip the gradients of ``params`` to ``optim.clip_grad``
    by their global norm, set the step's learning rate, take the optimizer step. Returns the
    norm before clipping (0-d)."""
    from colonnade.optim.clip import clip_coefficient
    from colonnade.optim.lr import lr_at

    o = config.optim
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in params))
    coef = clip_coefficient(norm, o.clip_grad)
    for p in params:
        p.grad.mul_(coef)
    for group in opt.param_groups:
        group["lr"] = lr_at(step, config.training.steps, o)
    opt.step()
    return norm
