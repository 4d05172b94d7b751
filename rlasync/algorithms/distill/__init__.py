"""On-policy distillation (docs/algorithms.md §9), one folder:

    config          rlasync.config.distill.AsyncDistillationConfig (the user's surface; rlasync.config stays a leaf)
    spec.py         DISTILL: the `Algorithm` spec (rlasync.algorithms.spec) the registry lists
    samples.py      DistillationSample (K+1 teacher candidates per position)
    routing.py      MOPD routing of a row to its teacher
    batching.py     Σ L² balanced micro-batches and their collation (plain padding-free rows)
    policy.py       the rollout policy: student generate -> teacher score -> one sample
    loop.py         AsyncDistillationLoop: the policy on the rollout task scheduler (the trainer's `loop_cls`)
    settings.py     the loop's RolloutSettings and the in-flight task budget
    loss.py         generalised JSD with narrowed support and tail bucket, chunked over the LM head
    learner_step.py DistillScorer / DistillLearnerStep: one learner step on collated rows
    objective.py    DistillationObjective: what a learner rank trains towards

Deliberately empty: a learner rank unpickling `DistillationObjective` imports this package, and must not load the
rollout runtime through it.
"""
