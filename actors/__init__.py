"""Ray shells, one file per service (docs/design.md §2): each builds a core object and exposes a few methods.

    cluster.py          Cluster          creates, wires and removes the actors of a RunSpec; runs the StepLoop
    cluster_weights.py  RayWeightSync    the weight-sync group and one sync (the StepLoop's weight transport)
    fanout.py                            calls to a group of actors and their deadlines, written once
    staleness_queue.py  QueueActor       the named StalenessQueue actor (rlasync.pipeline.QueueService)
    rollout.py          RolloutActor     any algorithm's rollout loop wired to the queue, the generation actors
                                         and, as the algorithm's spec says, reward actors or teachers
    generation.py       GenerationActor  a TorchEngine (CPU, or one GPU); receives weight broadcasts
    learner.py          LearnerActor     one training rank (gloo on CPU); sends weight broadcasts from rank 0
    teacher.py          TeacherScorer    a distillation teacher (a local engine, or a `vllm serve` client)
    reward.py           RewardActor      the reward functions, off the rollout actors

Actors never import each other; the Cluster (`actors.cluster`, reached from the trainers' `train()` through
`launch`) creates them and passes handles. It and the modules it delegates to (`cluster_*.py`, `fanout.py`) are
the only ones that call Ray for the driver.
"""
