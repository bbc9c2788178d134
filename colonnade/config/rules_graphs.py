"""Validation of ``training.cuda_graphs``: where capturing a layer in CUDA graphs cannot work.

A CUDA graph replays fixed kernels on fixed memory: every shape static, no host read inside
(a read would end the capture), the same parameter storage every replay, and the replays of
a layer's forward and backward in the order cudagraph trees recorded them. Each rule below
names the field that breaks one of these and the fix.
"""

from __future__ import annotations

from colonnade.config.sections import Config
from colonnade.device import has_gpu

FIX = "or set training.cuda_graphs=false"


def cuda_graph_rules(c: Config, _: int | None) -> list[str]:
    """Refusals of ``training.cuda_graphs=true`` (none when it is off)."""
    tr, p, m = c.training, c.parallel, c.model
    if not tr.cuda_graphs:
        return []
    head = "training.cuda_graphs=true"
    out: list[str] = []
    if tr.device == "cpu" or (tr.device == "auto" and not has_gpu()):
        where = "training.device='cpu'" if tr.device == "cpu" else "no GPU is visible"
        out.append(f"{head} needs a CUDA device ({where}): CUDA graphs replay GPU kernels; "
                   f"run on a GPU with training.device='cuda' or 'auto', {FIX}.")
    if m.num_experts > 0:
        out.append(f"{head} does not go with a MoE model (model.num_experts="
                   f"{m.num_experts}): the token dispatch sizes its buffers from the router's "
                   f"counts, read on the host every micro-batch; set model.num_experts=0 {FIX}.")
    for name, value in (("parallel.cp", p.cp), ("parallel.tp", p.tp), ("parallel.pp", p.pp)):
        if value > 1:
            out.append(f"{head} needs {name}=1 ({name}={value}): its collectives run between "
                       "the captured layers and its in-flight micro-batches overwrite the "
                       f"graphs' static outputs; set {name}=1 {FIX}.")
    for name, value in (("model.hidden_dropout", m.hidden_dropout),
                        ("model.attention_dropout", m.attention_dropout)):
        if value > 0:
            out.append(f"{head} needs {name}=0 ({name}={value}): the dropout masks come from "
                       f"the eager counter-based generator, outside any graph; set {name}=0 "
                       f"{FIX}.")
    if tr.recompute != "none":
        out.append(f"{head} needs training.recompute='none' (it is '{tr.recompute}'): the "
                   "recomputed forward runs outside the recorded graph order in backward; set "
                   f"training.recompute='none' {FIX}.")
    if p.zero >= 3:
        out.append(f"{head} does not go with ZeRO stage {p.zero}: ZeRO-3 frees "
                   "and re-gathers parameters into new memory, which a captured graph does not "
                   f"follow; use parallel.zero_stage <= 2 {FIX}.")
    return out
