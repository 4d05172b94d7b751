"""`RewardModelScorer`: a loaded sequence-classification reward model, its tokenizer, rendering and the forward.

    render(prompt, completion) -> text     the reward model's own chat template (or plain text, or `template`)
    score_texts(texts) -> [float]          tokenized, sorted by length, micro-batches of `batch_size`, right-padded

Rendering: a conversational prompt (a list of messages) plus the completion's messages (the assistant turn) are
rendered with the reward model tokenizer's chat template when it has one (no generation prompt; the template's own
special tokens, so the text is tokenized without adding more); a plain-text prompt, or a tokenizer without a chat
template, gives `prompt text + completion text` tokenized with the tokenizer's special tokens. `template` overrides:
a Jinja chat template string (rendered with the tokenizer as above) or `template(prompt, completion) -> str`
(tokenized with special tokens).

Forward: right padding always (a left-padded batch would shift the position ids of a model that derives them from
the sequence length), the batch's longest text sets the padded length, texts sorted by length so that a micro-batch
pads little, results returned in the texts' order. Transformers' classification head pools the last token that is
not the pad token; a tokenizer without a pad token scores one text at a time (no padding). The reward is the
logit of `label_index` (None: label 0 when the head has one label, else the last label: the "preferred" class of a
two-class head). Torch and transformers are imported here, never by `rlasync.rewards`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> str:
    """ "auto": cuda when this process sees a GPU (a RewardActor with `cluster.reward_num_gpus` > 0), else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """ "auto": bfloat16 on a GPU, float32 on the CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return DTYPES[dtype]


def text_of(value: Any) -> str:
    """A prompt or completion as plain text: a string as it is, a message list's contents joined by newlines."""
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence):
        return "\n".join(
            str(message.get("content", "")) if isinstance(message, dict) else str(message) for message in value
        )
    return str(value)


def _is_messages(value: Any) -> bool:
    return isinstance(value, list | tuple) and all(isinstance(m, dict) and "role" in m for m in value)


def completion_messages(completion: Any) -> list[dict[str, Any]]:
    """The completion as messages: its own list, or one assistant message of its text."""
    if _is_messages(completion):
        return [dict(message) for message in completion]
    return [{"role": "assistant", "content": text_of(completion)}]


class RewardModelScorer:
    """A reward model loaded in this process (see the module docstring).

    model:       a `*ForSequenceClassification` model (moved to `device`, cast to `dtype`, put in eval mode)
    tokenizer:   the reward model's tokenizer
    template:    None, a Jinja chat template string or `template(prompt, completion) -> str`
    label_index: which logit is the reward (None: see the module docstring)
    max_length:  texts are truncated to this many tokens (None: the tokenizer's `model_max_length` when it is
                 sensible, else no limit)
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_size: int = 32,
        template: str | Callable[[Any, Any], str] | None = None,
        label_index: int | None = None,
        max_length: int | None = None,
    ) -> None:
        self.device, self.dtype, self.batch_size = device, dtype, batch_size
        self.tokenizer, self.template = tokenizer, template
        num_labels = int(getattr(model.config, "num_labels", 1))
        index = (0 if num_labels == 1 else num_labels - 1) if label_index is None else label_index
        if not -num_labels <= index < num_labels:
            raise ValueError(
                f"RewardModel: label_index={label_index} but the reward model's head has {num_labels} label(s); "
                f"pick one in [0, {num_labels - 1}] (or None: the only label, or the last one)"
            )
        self.label_index = index
        pad_id = tokenizer.pad_token_id
        if pad_id is not None and getattr(model.config, "pad_token_id", None) is None:
            model.config.pad_token_id = pad_id  # the head pools the last non-pad token: it must know the pad
        self.pad_id = pad_id if getattr(model.config, "pad_token_id", None) == pad_id else None
        if self.pad_id is None:
            logger.warning(
                "reward model: tokenizer pad token %r differs from the model's pad_token_id %r (or there is none): "
                "scoring one text at a time",
                tokenizer.pad_token_id,
                getattr(model.config, "pad_token_id", None),
            )
        limit = getattr(tokenizer, "model_max_length", None)
        self.max_length = max_length if max_length is not None else (limit if limit and limit < 1_000_000 else None)
        self.model = model.to(device=device, dtype=dtype).eval()

    # ---- rendering --------------------------------------------------------------------------------------------

    def render(self, prompt: Any, completion: Any) -> tuple[str, bool]:
        """The text the reward model scores for one completion, and whether to add the tokenizer's special tokens
        when tokenizing it (False for a chat-template rendering, which has its own)."""
        if callable(self.template):
            return str(self.template(prompt, completion)), True
        chat_template = self.template if isinstance(self.template, str) else self.tokenizer.chat_template
        if chat_template and _is_messages(prompt):
            messages = [dict(message) for message in prompt] + completion_messages(completion)
            text = self.tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False)
            return str(text), False
        return text_of(prompt) + text_of(completion), True

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        kwargs: dict[str, Any] = {"add_special_tokens": add_special_tokens}
        if self.max_length is not None:
            kwargs.update(truncation=True, max_length=self.max_length)
        return list(self.tokenizer(text, **kwargs)["input_ids"])

    # ---- scoring ----------------------------------------------------------------------------------------------

    def score(self, samples: Sequence[tuple[Any, Any]]) -> list[float]:
        """One reward per `(prompt, completion)`, in their order."""
        rendered = [self.render(prompt, completion) for prompt, completion in samples]
        return self.score_ids([self.encode(text, special) for text, special in rendered])

    def score_texts(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[float]:
        """One reward per text, in their order."""
        return self.score_ids([self.encode(text, add_special_tokens) for text in texts])

    def micro_batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Indices of the texts per forward: sorted by length (longest first), at most `batch_size` each (one each
        without a pad token)."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        size = self.batch_size if self.pad_id is not None else 1
        return [order[start : start + size] for start in range(0, len(order), size)]

    @torch.inference_mode()
    def score_ids(self, token_ids: Sequence[Sequence[int]]) -> list[float]:
        """One reward per token-id sequence, in their order."""
        empty = [i for i, ids in enumerate(token_ids) if not ids]
        if empty:
            raise ValueError(f"reward model: text {empty[0]} renders to no tokens; it cannot be scored")
        rewards = [0.0] * len(token_ids)
        for indices in self.micro_batches([len(ids) for ids in token_ids]):
            width = max(len(token_ids[i]) for i in indices)
            input_ids = torch.full((len(indices), width), self.pad_id or 0, dtype=torch.long)
            attention_mask = torch.zeros((len(indices), width), dtype=torch.long)
            for row, i in enumerate(indices):
                ids = token_ids[i]
                input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                attention_mask[row, : len(ids)] = 1
            logits = self.model(
                input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device)
            ).logits
            values = logits[:, self.label_index].float().cpu().tolist()
            for i, value in zip(indices, values, strict=True):
                rewards[i] = float(value)
        return rewards
