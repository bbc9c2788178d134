"""The validator's q/k logit clipping rules (one of :data:`colonnade.config.validate.RULES`):
optim.qk_clip_threshold and optim.qk_clip_alpha (MuonClip, :mod:`colonnade.optim.qk_clip`).

What is supported: every dense layout without context parallelism (tp with or without sp, pp
with any schedule, dp with ZeRO 0-3, ep / expert tp: attention is dense), with AdamW or Muon,
for the attention classes whose logits are q_h . k_h / sqrt(d) of two linear projections
(llama, gpt2, mistral, qwen2, gpt-oss). Refused with tau > 0:

* parallel.cp > 1: a cp rank holds only its zigzag rows of q and k, so the per-head maximum
  over the whole (query, key) square is not seen by any rank (not implemented);
* multi-head latent attention (model.mla_kv_lora_rank > 0): its keys come from a shared latent
  and a head-shared rotary key, so a head's logit is not a product of its own W_q / W_k rows
  (Kimi K2's per-part scaling is not implemented);
* q/k RMSNorm (model.arch='qwen3'): the norm after the projections makes the logits independent
  of the rows' scale, so clipping them would shrink W_q / W_k every step without lowering a
  logit.
"""

from __future__ import annotations

from colonnade.config.model import ARCH_TRAITS
from colonnade.config.sections import Config


def qk_clip_rules(c: Config, _: int | None) -> list[str]:
    """tau >= 0, alpha in [0, 1]; with tau > 0 no cp, no MLA, no q/k norm."""
    o, m, out = c.optim, c.model, []
    tau = o.qk_clip_threshold
    if not tau >= 0:
        out.append(f"optim.qk_clip_threshold={tau} must be >= 0 (the largest pre-softmax "
                   "q/k logit a head may keep; 0 disables clipping, Kimi K2 used 100).")
    if not 0 <= o.qk_clip_alpha <= 1:
        out.append(f"optim.qk_clip_alpha={o.qk_clip_alpha} must be in [0, 1] (the share of "
                   "the clipping factor applied to W_q; the rest goes to W_k); 0.5 splits it "
                   "evenly.")
    if not tau > 0:
        return out
    if c.parallel.cp > 1:
        out.append(f"optim.qk_clip_threshold={tau} with parallel.cp={c.parallel.cp}: a cp "
                   "rank holds only its rows of q and k, so no rank sees a head's largest "
                   "logit (not implemented); set parallel.cp=1 (use tp / dp instead) or "
                   "optim.qk_clip_threshold=0.")
    if m.mla:
        out.append(f"optim.qk_clip_threshold={tau} with multi-head latent attention "
                   f"(model.mla_kv_lora_rank={m.mla_kv_lora_rank}): a head's logit is not a "
                   "product of its own W_q / W_k rows (the shared latent and rotary key), "
                   "and MLA's per-part clipping is not implemented; set "
                   "optim.qk_clip_threshold=0.")
    traits = ARCH_TRAITS.get(m.arch)
    if traits is not None and traits.qk_norm:
        out.append(f"optim.qk_clip_threshold={tau} with model.arch='{m.arch}': its q/k "
                   "RMSNorm makes the logits independent of the W_q / W_k rows' scale, so "
                   "clipping cannot lower them (the norm already bounds them); set "
                   "optim.qk_clip_threshold=0.")
    return out
