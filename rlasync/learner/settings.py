"""The learner's slice of the user's config, derived once (`LearnerSettings.from_config`) on the driver and handed
to every learner rank: model init options, precision, the optimizer, the loss of the objective, and the planner's
token budget. The learner core reads only these typed fields, never the flat TRL-named config itself.

    settings = GRPO.learner_settings(config, token_budget=4096)   # rlasync.algorithms.grpo.spec: objective + loss
    learner = Learner(model_path, settings, rank=0, world_size=1, device=torch.device("cpu"))

The objective is a class (an `rlasync.learner.objectives.Objective` subclass, from the algorithm's folder): pickled
by reference, it imports only its own module on a learner rank. The learner core never names an algorithm.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlasync.config.base import TrainerConfig, check_checkpointing_layers
from rlasync.config.kernels import KernelSettings
from rlasync.learner.step import OptimizerSettings

if TYPE_CHECKING:
    from peft import PeftConfig


@dataclass(frozen=True)
class LearnerSettings:
    """Everything a learner rank needs of the run's configuration (picklable: it travels to the actors)."""

    objective: type  # the algorithm's `Objective` subclass (rlasync.learner.objectives)
    token_budget: int  # tokens per packed row; <= 0: a fixed count of samples per row (per_device_train_batch_size)
    optimizer: OptimizerSettings
    loss: Any  # the objective's loss settings: an instance of `objective.loss_cls`
    teacher_ids: tuple[str, ...] = ("default",)  # with teachers: stable order = teacher_id_idx
    dtype: str = "float32"
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    gradient_checkpointing: bool = True
    gradient_checkpointing_layers: str | int = "auto"  # "auto" (by memory on CUDA), "all" or a layer count
    use_reentrant: bool = False
    torch_compile: bool | None = None  # decoder layers compiled (regional); None: on CUDA only (the learner decides)
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    row_bucket: int = 0  # > 0: pad each row's unique tokens to a multiple of it (static shapes); 0: no padding
    # (with torch_compile=None it is the bucket of compiled layers; a learner that resolves to eager sets it to 0)
    bf16: bool = False
    fp16: bool = False
    seed: int = 42
    per_device_train_batch_size: int = 8
    temperature: float = 1.0
    max_grad_norm: float = 1.0
    peft_config: PeftConfig | None = None  # a peft.LoraConfig: train adapters only (rlasync.learner.lora)
    lora_sync: str = "adapter"  # with peft_config: "adapter" (send A/B only) or "merged" (full merged weights)
    gpu_share: float = 1.0  # the learner's part of its GPU (cluster.learner_num_gpus < 1: it shares it)
    kernels: KernelSettings = dataclasses.field(default_factory=KernelSettings)  # the config's `kernels` section

    def __post_init__(self) -> None:
        if not (isinstance(self.objective, type) and hasattr(self.objective, "loss_cls")):
            raise ValueError(
                f"LearnerSettings.objective={self.objective!r}: give an rlasync.learner.objectives.Objective subclass "
                "(an algorithm's spec builds it: rlasync.algorithms.registry.get(name).learner_settings(...))"
            )
        expected = self.objective.loss_cls
        if not isinstance(self.loss, expected):
            raise TypeError(
                f"objective {self.objective.__name__} needs a {expected.__name__} loss, got {type(self.loss).__name__}"
            )
        from rlasync.weights.adapter import check_lora_sync, check_peft_config

        check_peft_config(self.peft_config)
        check_lora_sync(self.lora_sync)
        object.__setattr__(
            self,
            "gradient_checkpointing_layers",
            check_checkpointing_layers(self.gradient_checkpointing_layers, self.gradient_checkpointing),
        )
        if self.torch_compile not in (None, True, False):
            raise ValueError(f"torch_compile={self.torch_compile!r}: use True, False or None (auto: on CUDA)")
        if self.row_bucket < 0:
            raise ValueError(f"row_bucket={self.row_bucket}: use 0 (no padding) or a positive multiple of tokens")

    def resolved(self, cuda: bool) -> LearnerSettings:
        """These settings on a rank whose device is (not) CUDA: `torch_compile` a bool
        (rlasync.model.compilation.resolve_torch_compile); `row_bucket` 0 when "auto" leaves the layers eager (its
        bucket was chosen for compiled layers; an explicit choice keeps the given bucket)."""
        from rlasync.model.compilation import resolve_torch_compile

        compiled = resolve_torch_compile(
            self.torch_compile, cuda=cuda, backend=self.torch_compile_backend, mode=self.torch_compile_mode
        )
        bucket = 0 if self.torch_compile is None and not compiled else self.row_bucket
        return dataclasses.replace(self, torch_compile=compiled, row_bucket=bucket)

    @classmethod
    def from_config(
        cls,
        config: TrainerConfig,
        *,
        objective: type,
        loss: Any,
        token_budget: int,
        max_steps: int | None = None,
        teacher_ids: list[str] | None = None,
        peft_config: PeftConfig | None = None,
        optimizer_overrides: dict[str, Any] | None = None,
    ) -> LearnerSettings:
        """The common fields of the user's config, with the algorithm's `objective` class and `loss` settings (its
        spec passes them: `Algorithm.learner_settings`). `max_steps` overrides the scheduler's horizon when the
        driver resolved it (e.g. distillation with max_steps=-1)."""
        optimizer = OptimizerSettings.from_config(config)
        if max_steps is not None:
            optimizer = dataclasses.replace(optimizer, max_steps=max_steps)
        if optimizer_overrides:  # the trainer's optimizers=(class, scheduler factory)
            optimizer = dataclasses.replace(optimizer, **optimizer_overrides)
        compiled = config.torch_compile is not False  # None ("auto") may compile: the learner resolves it
        from rlasync.model.row_shapes import row_bucket  # compiled layers see few row shapes (docs/algorithms.md §5.5)

        return cls(
            objective=objective,
            token_budget=int(token_budget),
            optimizer=optimizer,
            loss=loss,
            teacher_ids=tuple(teacher_ids or ["default"]),
            dtype=config.dtype,
            model_init_kwargs=config.model_init_kwargs,
            trust_remote_code=config.trust_remote_code,
            gradient_checkpointing=config.gradient_checkpointing,
            use_reentrant=config.use_reentrant,
            gradient_checkpointing_layers=config.gradient_checkpointing_layers,
            torch_compile=config.torch_compile,
            torch_compile_backend=config.torch_compile_backend,
            torch_compile_mode=config.torch_compile_mode,
            row_bucket=row_bucket(int(token_budget)) if compiled and getattr(objective, "bucket_rows", False) else 0,
            bf16=bool(config.bf16),
            fp16=bool(config.fp16),
            seed=config.seed,
            per_device_train_batch_size=config.per_device_train_batch_size,
            temperature=config.temperature,
            max_grad_norm=config.max_grad_norm,
            peft_config=peft_config,
            lora_sync=getattr(config.cluster, "lora_sync", "adapter"),
            gpu_share=_gpu_share(getattr(config.cluster, "learner_num_gpus", 0.0)),
            kernels=KernelSettings.of(config.kernels),
        )


def _gpu_share(learner_num_gpus: float) -> float:
    """A learner given a fraction of a GPU plans its memory within that fraction; a whole GPU (or more, or none
    declared) is its own."""
    return float(learner_num_gpus) if 0 < learner_num_gpus < 1 else 1.0
