"""The combination fuzzer and the generated support matrix (issue 37).

* :mod:`colonnade.fuzz.space`: a seeded generator of whole configurations (architecture, MoE,
  every parallel axis, ZeRO, recompute, precision, dropout, document resets, odd sizes) on at
  most 8 ranks; draws include combinations the validator refuses today.
* :mod:`colonnade.fuzz.run`: one draw's verdict: refused by the validator before any group is
  made (with the rules that refused it), or run k steps on the rank pool and compared with the
  single-process run of the same model and data (loss, gathered gradients and grad norm each
  step, parameters after the last step).
* :mod:`colonnade.fuzz.main`: ``colonnade bench fuzz``: the table, the results JSON, the
  reproducing command of each failing case.
* :mod:`colonnade.fuzz.matrix`: the support matrix, generated from the validator's rules.
"""
