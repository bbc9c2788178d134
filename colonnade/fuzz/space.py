"""The fuzzer's space: a seeded draw of one whole configuration on at most 8 ranks.

A draw (:func:`draw_case`) picks, each from its own stream of ``random.Random(f"{seed}/{index}")``
(so case ``index`` of run ``seed`` is the same on every machine, whatever the other cases):

* the model: every ``model.arch`` of :data:`colonnade.config.choices.ARCHS` (MLA widths for
  deepseek_v3, sinks / windows / biases for gpt_oss, windows for mistral and qwen2, q/k norm
  for qwen3), 2-4 layers, hidden 32-64, 2-8 heads (odd counts included; head_dim when the
  heads do not divide the width), GQA, an odd prime vocabulary, seq 16-32, tied or not,
  dropout, label smoothing; dense or mixture of experts (router, top-k, capacity, aux-loss
  type and coefficients, shared expert, dense prefix, dispatcher);
* the layout: a world of 1-8 ranks factored over tp, pp, cp and dp, sp, cp_attention (and
  hierarchical cp's inner size), the schedule and vp (an uneven ``pipeline_layout``
  sometimes), ZeRO stage and shard size, ep and expert_tp;
* the run: recompute mode and method, precision (fp64 mostly; bf16 for the looser check),
  micro-batch size and count, document resets;
* the optimizer: ``optim.name``, each of :data:`colonnade.config.choices.OPTIMIZERS` equally
  often, from a stream of its own (``.../optim``), so adding an optimizer left every other
  field of every earlier draw as it was.

Nothing is filtered here: a draw the validator refuses is a verdict of its own
(:mod:`colonnade.fuzz.run`), so the generator needs no change when a refusal is lifted.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

from colonnade.config.choices import (
    ARCHS,
    CP_ATTENTIONS,
    MOE_AUX_LOSS_TYPES,
    MOE_DISPATCHERS,
    MOE_ROUTERS,
    OPTIMIZERS,
    RECOMPUTE_METHODS,
    RECOMPUTE_MODES,
    SCHEDULES,
)
from colonnade.config.sections import (
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainingConfig,
)

WORLD_WEIGHTS: dict[int, float] = {1: 0.5, 2: 4, 3: 0.5, 4: 4, 6: 1, 8: 3}
"""How often each world size is drawn (1-8 ranks; 5 and 7 only factor as one axis, rarely
useful, so they are left out)."""
AXIS_WEIGHTS: dict[str, float] = {"tp": 1.0, "pp": 1.0, "cp": 1.0, "dp": 1.2}
"""How each prime factor of the world picks its axis."""
VOCABS: tuple[int, ...] = (97, 101, 127, 131)
"""Odd prime vocabularies: never divisible by tp, so the vocab padding is always exercised."""
EOD = 0
"""The end-of-document token of the synthetic data (document resets)."""
EOD_RATE = 0.15
"""Share of tokens replaced by :data:`EOD` when a case resets at documents."""


@dataclass(frozen=True)
class Case:
    """One draw: the configuration, the world it runs on and its data's document resets."""

    seed: int
    """The run's seed (``--seed``)."""
    index: int
    """The case's index in the run (``--case``)."""
    config: Config
    """The configuration as drawn (unresolved: dp, microbatches and the global batch derived
    by :func:`colonnade.config.validate.resolve` from :attr:`world`)."""
    world: int
    """Ranks the case runs on."""
    eod: int | None
    """Token id that ends a document in the data (None: no document resets)."""

    @property
    def name(self) -> str:
        """``<seed>/<index>``."""
        return f"{self.seed}/{self.index}"

    @property
    def summary(self) -> str:
        """A one-line layout summary, e.g. ``llama moe4k2 tp2sp pp2:zbv/2 cp2a dp2 z1 ep2 fp64``."""
        m, p, t = self.config.model, self.config.parallel, self.config.training
        parts = [m.arch + (f" moe{m.num_experts}k{m.moe_top_k}" if m.moe else "")]
        if self.config.optim.name != "adamw":
            parts.append(self.config.optim.name)
        if p.tp > 1 or p.sp:
            parts.append(f"tp{p.tp}{'sp' if p.sp else ''}")
        if p.pp > 1 or p.schedule != "1f1b" or p.vp > 1:
            lay = "" if p.pipeline_layout is None else "~" + "-".join(map(str, p.pipeline_layout))
            parts.append(f"pp{p.pp}:{p.schedule}/{p.vp}{lay}")
        if p.cp > 1:
            kind = {"ring": "r", "all_to_all": "a"}.get(p.cp_attention, f"h{p.cp_a2a_size}")
            parts.append(f"cp{p.cp}{kind}")
        dp = self.world // max(1, p.tp * p.pp * p.cp)
        if dp > 1:
            parts.append(f"dp{dp}")
        if p.zero_stage:
            parts.append(f"z{p.zero_stage}" + (f"/{p.zero_shard_size}" if p.zero_shard_size
                                               else ""))
        if p.ep > 1 or (p.expert_tp or 1) > 1:
            parts.append(f"ep{p.ep}" + (f"x{p.expert_tp}" if (p.expert_tp or 1) > 1 else ""))
        if t.recompute != "none":
            parts.append(f"rc:{t.recompute[:3]}")
        if m.hidden_dropout or m.attention_dropout:
            parts.append("drop")
        if self.eod is not None:
            parts.append("docs")
        parts.append(t.precision)
        return " ".join(parts)

    def overrides(self) -> dict[str, Any]:
        """Every field that differs from its default, as ``{"section.field": value}``."""
        out: dict[str, Any] = {}
        base = Config()
        for section in dataclasses.fields(Config):
            ours, theirs = getattr(self.config, section.name), getattr(base, section.name)
            for f in dataclasses.fields(ours):
                value = getattr(ours, f.name)
                if value != getattr(theirs, f.name):
                    out[f"{section.name}.{f.name}"] = value
        return out


def draw_case(seed: int, index: int, steps: int = 2) -> Case:
    """Case ``index`` of the run seeded ``seed``: a whole configuration trained ``steps``
    optimizer steps (see the module docstring for the space)."""
    rng = random.Random(f"colonnade-fuzz/{seed}/{index}")
    world = _weighted(rng, WORLD_WEIGHTS)
    degrees = _factor(rng, world)
    model = _draw_model(rng)
    if rng.random() < 0.4:
        model = _draw_moe(rng, model)
    parallel = _draw_parallel(rng, model, degrees, world)
    layers = model.num_layers
    chunks = parallel.pp * parallel.vp
    if chunks > layers and rng.random() < 0.8:
        layers = chunks  # else refused unless a pipeline_layout places them
    model = dataclasses.replace(model, num_layers=layers)
    if parallel.pp > 1 and rng.random() < 0.25:
        parallel = dataclasses.replace(parallel, pipeline_layout=_uneven(rng, layers, chunks))
    training = _draw_training(rng, steps)
    resets = rng.random() < 0.2
    data = DataConfig()
    if resets:
        positions, attention = rng.choice([(True, True), (True, False), (False, True)])
        data = DataConfig(reset_position_ids=positions, reset_attention_mask=attention)
    name = random.Random(f"colonnade-fuzz/{seed}/{index}/optim").choice(OPTIMIZERS)
    optim = OptimConfig(name=name, lr=1e-2, min_lr=1e-3, warmup_steps=1, weight_decay=0.1,
                        clip_grad=0.5)
    config = Config(model=model, parallel=parallel, training=training, optim=optim, data=data)
    return Case(seed, index, config, world, EOD if resets else None)


def _weighted(rng: random.Random, weights: dict[Any, float]) -> Any:
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def _factor(rng: random.Random, world: int) -> dict[str, int]:
    """The world's prime factors, each given to an axis drawn by :data:`AXIS_WEIGHTS`."""
    degrees = dict.fromkeys(AXIS_WEIGHTS, 1)
    n, p = world, 2
    while n > 1:
        while n % p == 0:
            degrees[_weighted(rng, AXIS_WEIGHTS)] *= p
            n //= p
        p += 1
    return degrees


def _draw_model(rng: random.Random) -> ModelConfig:
    """A tiny dense model of a drawn architecture (its family's fields set)."""
    arch = rng.choice(ARCHS)
    hidden = rng.choice((32, 48, 64))
    heads = rng.choice((2, 3, 4, 4, 6, 8))
    head_dim = None
    if hidden % heads and rng.random() < 0.85:
        head_dim = rng.choice((8, 16))
    kv = rng.choice([k for k in range(1, heads + 1) if heads % k == 0])
    dropout = rng.choice((0.0, 0.0, 0.0, 0.1))
    fields: dict[str, Any] = dict(
        arch=arch, num_layers=rng.choice((2, 3, 4)), hidden_size=hidden, num_heads=heads,
        head_dim=head_dim, num_kv_heads=None if arch == "gpt2" else kv,
        vocab_size=rng.choice(VOCABS), max_seq_len=32, init_std=0.05,
        hidden_dropout=dropout, attention_dropout=rng.choice((0.0, dropout)),
        tie_embeddings=arch == "gpt2" if rng.random() < 0.7 else arch != "gpt2",
        bias=arch in ("gpt2", "gpt_oss"))
    if arch in ("mistral", "qwen2", "gpt_oss") and rng.random() < 0.6:
        fields["sliding_window"] = rng.choice((4, 8))
        if arch == "gpt_oss":
            fields["sliding_window_layers"] = (0,)
    if arch == "qwen2":
        fields["qkv_bias"] = True
    if arch == "deepseek_v3":
        fields.update(num_kv_heads=None, head_dim=None, bias=False,
                      mla_q_lora_rank=rng.choice((None, 16)), mla_kv_lora_rank=16,
                      mla_qk_nope_head_dim=8, mla_qk_rope_head_dim=rng.choice((4, 8)),
                      mla_v_head_dim=8)
    if arch in ("qwen3", "gpt_oss") and head_dim is None and rng.random() < 0.5:
        fields["head_dim"] = rng.choice((8, 16))
    return ModelConfig(**fields)


def _draw_moe(rng: random.Random, model: ModelConfig) -> ModelConfig:
    """``model`` with routed experts on every layer (a dense prefix sometimes)."""
    experts = rng.choice((2, 4, 4, 6, 8))
    router = rng.choice(MOE_ROUTERS)
    fields: dict[str, Any] = dict(
        num_experts=experts, moe_top_k=rng.randint(1, min(3, experts)),
        moe_ffn_hidden_size=rng.choice((16, 32)), moe_router=router,
        moe_aux_loss_type=rng.choice(MOE_AUX_LOSS_TYPES),
        moe_aux_loss_coeff=rng.choice((0.0, 0.01)), moe_z_loss_coeff=rng.choice((0.0, 1e-3)),
        moe_capacity_factor=rng.choice((None, None, 1.0, 1.5)),
        moe_first_dense_layers=1 if rng.random() < 0.2 else 0)
    if rng.random() < 0.3:
        fields["moe_shared_expert_ffn_hidden_size"] = 32
    if model.arch == "gpt_oss":
        fields["moe_router_bias"] = True
    if model.arch == "deepseek_v3" and router == "sigmoid" and experts % 2 == 0:
        fields.update(moe_n_group=2, moe_topk_group=1, moe_routed_scaling_factor=2.5)
    return dataclasses.replace(model, **fields)


def _draw_parallel(rng: random.Random, model: ModelConfig, degrees: dict[str, int],
                   world: int) -> ParallelConfig:
    """The layout: the drawn degrees, sp, cp attention, schedule and vp, ZeRO, ep."""
    tp, pp, cp, dp = degrees["tp"], degrees["pp"], degrees["cp"], degrees["dp"]
    schedule, vp = "1f1b", 1
    if pp > 1:
        schedule = rng.choice(SCHEDULES)
        vp = {"interleaved_1f1b": rng.choice((2, 2, 3)), "zbv": 2}.get(schedule, 1)
    elif rng.random() < 0.05:
        schedule = rng.choice(SCHEDULES)
    zero = rng.choice((0, 0, 1, 2, 3))
    shard = None
    if zero and dp * cp >= 4 and rng.random() < 0.4:
        shard = rng.choice([s for s in (2, 4) if (dp * cp) % s == 0] or [2])
    ep, expert_tp = 1, None
    if model.moe:
        ep = rng.choice([e for e in (1, 2, 4, 8) if e <= tp * cp * dp])
        if rng.random() < 0.5:
            expert_tp = rng.choice((1, 2, 2))
    cp_attention = rng.choice(CP_ATTENTIONS)
    a2a = None  # hierarchical cp's inner size, a divisor of cp (or a refused one, rarely)
    if cp_attention == "hierarchical":
        a2a = rng.choice([a for a in range(1, cp + 1) if cp % a == 0])
        a2a = 3 if rng.random() < 0.1 else a2a
    return ParallelConfig(
        tp=tp, pp=pp, vp=vp, cp=cp, sp=tp > 1 and rng.random() < 0.7,
        cp_attention=cp_attention, cp_a2a_size=a2a, schedule=schedule, zero_stage=zero,
        zero_shard_size=shard, ep=ep, expert_tp=expert_tp,
        moe_dispatcher=rng.choice(MOE_DISPATCHERS), bucket_size=rng.choice((1000, 10**8)),
        timeout_s=120.0)


def _uneven(rng: random.Random, layers: int, chunks: int) -> tuple[int, ...]:
    """``layers`` split over ``chunks`` virtual stages unevenly: fewer on the first and last
    (which hold the embedding and the head) when there are layers to spare."""
    out = [layers // chunks] * chunks
    for i in range(layers - sum(out)):
        out[1 + i % max(1, chunks - 2) if chunks > 2 else i % chunks] += 1
    if chunks > 1 and out[0] > 0 and rng.random() < 0.5:
        out[0] -= 1
        out[rng.randrange(1, chunks)] += 1
    return tuple(out)


def _draw_training(rng: random.Random, steps: int) -> TrainingConfig:
    """Steps, batch shape, precision, recompute and the label smoothing of one case."""
    seq = 16 if rng.random() < 0.5 else rng.choice((16, 24, 32))
    return TrainingConfig(
        steps=steps, seq_len=seq, micro_batch_size=rng.choice((1, 2)),
        microbatches=rng.choice((1, 2, 2, 3, 4)),
        precision="fp64" if rng.random() < 0.85 else "bf16", seed=rng.randrange(1000),
        eval_interval=0, recompute=rng.choice(RECOMPUTE_MODES),
        recompute_method=rng.choice(RECOMPUTE_METHODS), device="cpu",
        label_smoothing=rng.choice((0.0, 0.0, 0.1)))
