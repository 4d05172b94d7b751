"""Ray shells, one file per service (DESIGN.md §2): each builds a core object and exposes a few methods.

    staleness_queue.py  QueueActor       the named StalenessQueue actor (rlasync.pipeline.QueueService)
    rollout.py          RolloutActor     an AsyncRolloutLoop wired to the queue and the generation actors
    generation.py       GenerationActor  a TorchEngine (CPU, or one GPU); receives weight broadcasts
    learner.py          LearnerActor     one training rank (gloo on CPU); sends weight broadcasts from rank 0

Actors never import each other; the driver (`rlasync.trainers`) creates them and passes handles.
"""
