"""rlasync: asynchronous RL post-training for LLMs on Ray actors.

Importing the package is cheap: heavy modules (torch, transformers, ray) load only when their
submodules are used.
"""

__version__ = "0.1.0"
