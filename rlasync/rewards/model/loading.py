"""Loading a `RewardModel`'s source in the process that scores: a folder (`from_pretrained`) or a loaded model's
travelling payload (the config and state dict it was given as), with its tokenizer. Imports torch and transformers."""

from __future__ import annotations

import logging
from typing import Any

from rlasync.rewards.model.scorer import RewardModelScorer, resolve_device, resolve_dtype

logger = logging.getLogger(__name__)


def load_scorer(reward: Any) -> RewardModelScorer:
    """The reward model of `reward` (a `RewardModel`: its source and settings), loaded on its device in its dtype,
    with its tokenizer."""
    # the concrete modules, not transformers' lazy attributes: those race when another thread (a sync reward
    # function in the same actor) resolves them at the same moment (AttributeError on a half-imported module)
    import transformers
    from transformers.models.auto.configuration_auto import AutoConfig
    from transformers.models.auto.modeling_auto import AutoModelForSequenceClassification
    from transformers.models.auto.tokenization_auto import AutoTokenizer

    device = resolve_device(reward.device)
    dtype = resolve_dtype(reward.dtype, device)
    source = reward.source
    if isinstance(source, str):
        model = AutoModelForSequenceClassification.from_pretrained(source, dtype=dtype)
    else:
        config_dict = dict(source["config"])
        model_type = config_dict.pop("model_type", None)
        config = AutoConfig.for_model(model_type, **config_dict)
        model_cls = getattr(transformers, source["class_name"], None)
        if model_cls is None:
            model = AutoModelForSequenceClassification.from_config(config)
        else:
            model = model_cls(config)
        missing, unexpected = model.load_state_dict(source["state_dict"], strict=False)
        if missing or unexpected:
            raise ValueError(
                f"reward model '{reward.__name__}': the loaded model's weights do not fit its rebuilt "
                f"{type(model).__name__} (missing {list(missing)[:5]}, unexpected {list(unexpected)[:5]}); pass "
                "the model's folder instead"
            )
    tokenizer = reward.tokenizer
    if tokenizer is None or isinstance(tokenizer, str):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer if tokenizer is not None else source)
    scorer = RewardModelScorer(
        model,
        tokenizer,
        device=device,
        dtype=dtype,
        batch_size=reward.batch_size,
        template=reward.template,
        label_index=reward.label_index,
        max_length=reward.max_length,
    )
    logger.info(
        "reward model '%s' loaded on %s in %s (%d labels, reward = logit %d)",
        reward.__name__,
        device,
        str(dtype).removeprefix("torch."),
        int(model.config.num_labels),
        scorer.label_index,
    )
    return scorer
