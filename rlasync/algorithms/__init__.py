"""The algorithms: one folder per algorithm (`grpo/`, `distill/`) with its rollout policy, learner objective, loss
and data side, and one registry (`rlasync.algorithms.registry`) of `Algorithm` specs (`rlasync.algorithms.spec`).
The runtime below (queue, driver, rollout scheduler, engine pool, learner core, packing, weights) knows no
algorithm by name: the trainers, the Cluster and the settings ask the spec.

Deliberately empty: a learner rank unpickling an objective class imports this package, and must not load the
rollout runtime through it.
"""
