"""The validator's hierarchical context-parallelism rules (one of
:data:`colonnade.config.validate.RULES`): parallel.cp_attention='hierarchical' and
parallel.cp_a2a_size.

Hierarchical cp (:mod:`colonnade.context_parallel.hierarchical`) runs all-to-all attention
inside groups of a = cp_a2a_size consecutive cp ranks and ring attention across the cp / a
groups: the inner all-to-all splits the tp-local heads over a ranks (heads / tp divisible by a;
kv heads / tp and a dividing one another, as all_to_all's rule with cp replaced by a); the
ring then has no head condition. The zigzag split's seq_len rule (2 x cp) is
:func:`colonnade.config.validate._context`'s, shared by every cp attention.
"""

from __future__ import annotations

from colonnade.config.sections import Config


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def hierarchical_rules(c: Config, _: int | None) -> list[str]:
    """parallel.cp_a2a_size set exactly with cp_attention='hierarchical', dividing cp, and
    the inner all-to-all's head split possible."""
    p, m, out = c.parallel, c.model, []
    a = p.cp_a2a_size
    if p.cp_attention != "hierarchical":
        if a is not None:
            out.append(f"parallel.cp_a2a_size={a} is used only by parallel.cp_attention="
                       f"'hierarchical' (got '{p.cp_attention}'); set cp_attention="
                       "'hierarchical' or unset cp_a2a_size.")
        return out
    fits = _divisors(p.cp) if p.cp >= 1 else []
    if a is None:
        out.append(f"parallel.cp_attention='hierarchical' needs parallel.cp_a2a_size, the "
                   f"ranks of its inner all-to-all group (cp = cp_a2a_size x ring size); set "
                   f"it to a divisor of parallel.cp={p.cp}, one of {fits}.")
        return out
    if a < 1 or p.cp < 1 or p.cp % a:
        out.append(f"parallel.cp_a2a_size={a} must divide parallel.cp={p.cp} (cp = "
                   f"cp_a2a_size x ring size); use one of {fits}, or change cp.")
        return out
    if p.tp < 1 or m.num_heads % p.tp or m.kv_heads % p.tp:
        return out  # the head / tp rule is _model_shape's
    heads, kv = m.num_heads // p.tp, m.kv_heads // p.tp
    ok = [d for d in fits if heads % d == 0 and (kv % d == 0 or d % kv == 0)]
    if heads % a:
        out.append(f"parallel.cp_attention='hierarchical' needs model.num_heads / parallel.tp "
                   f"= {heads} divisible by parallel.cp_a2a_size={a} (its all-to-all splits "
                   f"the heads over the inner group); use cp_a2a_size in {ok}, or change tp.")
    elif kv and kv % a and a % kv:
        out.append(f"parallel.cp_attention='hierarchical' needs model.num_kv_heads / "
                   f"parallel.tp = {kv} divisible by parallel.cp_a2a_size={a} or dividing it "
                   f"(kv heads split or replicated over the inner group); use cp_a2a_size in "
                   f"{ok}, or change tp or num_kv_heads.")
    return out
