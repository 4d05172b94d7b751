"""Asynchronous GRPO (docs/algorithms.md §1-§8), one folder:

    config          rlasync.config.grpo.AsyncGRPOConfig (the user's surface; rlasync.config stays a leaf)
    spec.py         GRPO: the `Algorithm` spec (rlasync.algorithms.spec) the registry lists
    objective.py    GrpoObjective: tree-packed rows (rlasync.packing) -> GrpoLearnerStep
    learner_step.py GrpoLearnerStep: one optimizer step of grpo_loss on tree-packed micro-batches
    loop.py         AsyncRolloutLoop: the policy on the rollout task scheduler (the trainer's `loop_cls`)
    policy.py       RolloutPolicy: TRL's hooks (generate_one, the tool loop, environments, compute_advantages)
    settings.py     the loop's RolloutSettings
    loss            rlasync.algorithms.grpo.loss (grpo_loss, LossConfig)

Deliberately empty: a learner rank unpickling `GrpoObjective` imports this package, and must not load the rollout
runtime through it.
"""
