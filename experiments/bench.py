"""experiment=bench: the resident bench as a decode job (the headline GPU numbers).

Named methods (``experiment.methods``: arms + optional runtime, bandit, planner; see
:func:`experiments.decode.bench_methods`) decode the same prompts side by side in one process,
rotated batch by batch, after a warm-up call and an untimed prefill of every prompt per method,
against the method ``ar`` (the run runtime's AR: the resident loop on hardware=h200). Records
are decode records (one per prompt, turn and method) and the job metrics hold
``<method>/{speedup,speedup_pooled,greedy_equal,alpha,tau,tps}``. A cell (dataset × batch ×
temperature) is one job: ``python run.py -m experiment=bench dataset=humaneval,mtbench``.
"""
from __future__ import annotations

from experiments.decode import run

__all__ = ["run"]
