"""Shared helpers of the distillation tests, handed out as fixtures (`--import-mode=importlib`: test modules
cannot import each other)."""

import asyncio
import types

import numpy as np
import pytest

from rlasync.algorithms.distill.samples import DistillationSample
from rlasync.config import AsyncDistillationConfig
from rlasync.engine.base import EngineError, RequestRejectedError, ScoreResult
from rlasync.records import PromptLease, TurnRecord


def make_sample(prompt_len, completion_len, prompt_id=0, teacher_id="default", width=3, start_id=0, **kwargs):
    """A sample of `prompt_len + completion_len` tokens with ids `start_id, start_id+1, ...`; completion position
    `i`'s teacher row holds the candidates `[100 + i, 200 + i]` with log-probs `[-0.5, -1.5]`."""
    length = prompt_len + completion_len
    ids = np.full((length, width), -1, dtype=np.int64)
    lps = np.full((length, width), -np.inf, dtype=np.float32)
    for i in range(completion_len):
        ids[prompt_len + i, :2] = [100 + i, 200 + i]
        lps[prompt_len + i, :2] = [-0.5, -1.5]
    return DistillationSample(
        input_ids=np.arange(start_id, start_id + length),
        completion_mask=[0] * prompt_len + [1] * completion_len,
        teacher_topk_ids=ids,
        teacher_topk_logprobs=lps,
        prompt_id=prompt_id,
        teacher_id=teacher_id,
        **kwargs,
    )


@pytest.fixture
def sample_factory():
    """`sample_factory(prompt_len, completion_len, prompt_id=0, teacher_id="default", width=3, ...)`."""
    return make_sample


# ---- fakes of the worker loop ---------------------------------------------------------------------------------


EOS = 2
PAD = 0


class FakeTokenizer:
    """BOS (1), then one id per character (`ord % 50 + 10`) per message; `<eos>` (2) decodes as "<eos>" unless
    special tokens are skipped."""

    eos_token_id = EOS
    pad_token_id = PAD

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, **kwargs):
        ids = [1] + [ord(c) % 50 + 10 for message in messages for c in message["content"]]
        return {"input_ids": ids + ([3] if add_generation_prompt else [])}

    def decode(self, ids, skip_special_tokens=False):
        names = {EOS: "<eos>", PAD: "<pad>", 1: "<bos>"}
        return "".join(("" if skip_special_tokens else names[i]) if i in names else chr(i) for i in ids)


class FakeClock:
    def __init__(self):
        self.now = 100.0
        self.slept = []

    def __call__(self):
        return self.now

    async def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


class FakeStudent:
    """Answers each request with `outputs[len(requests) % len(outputs)]` (ids, finish_reason), after `yields`
    event-loop turns; `fail` transient errors first; `reject(prompt_ids)` -> RequestRejectedError."""

    def __init__(self, outputs=(([70, 71, EOS], "stop"),), clock=None, generate_s=0.0):
        self.outputs = list(outputs)
        self.requests = []
        self.fail = 0
        self.reject = lambda prompt_ids: False
        self.gate = None
        self.clock = clock
        self.generate_s = generate_s
        self.inflight = self.max_inflight = 0

    async def generate(self, prompt_ids, sampling):
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(0)
            if self.fail:
                self.fail -= 1
                raise EngineError("student hiccup")
            if self.reject(prompt_ids):
                raise RequestRejectedError("prompt too long")
            ids, finish = self.outputs[len(self.requests) % len(self.outputs)]
            self.requests.append((list(prompt_ids), sampling))
            if self.clock is not None:
                self.clock.now += self.generate_s
            return TurnRecord(list(prompt_ids), list(ids), finish_reason=finish)
        finally:
            self.inflight -= 1


class FakeTeacher:
    """Teacher-forced scores: position i gets top-k ids `[base + i, base + i + 1, ...]` with log-probs
    `-0.1 × (rank)`; the realised token's log-prob is -5.0 (so it is outside the top-k); `score_s` seconds of the
    fake clock pass per call."""

    def __init__(self, base=500, clock=None, score_s=0.0):
        self.base = base
        self.requests = []
        self.fail = 0
        self.reject = False
        self.clock = clock
        self.score_s = score_s

    async def score(self, token_ids, prompt_length, top_k):
        return await self._score(token_ids, prompt_length, top_k)

    async def _score(self, token_ids, prompt_length, top_k, **kwargs):
        await asyncio.sleep(0)
        if self.fail:
            self.fail -= 1
            raise EngineError("teacher hiccup")
        if self.reject:
            raise RequestRejectedError("too long for the teacher")
        self.requests.append((list(token_ids), prompt_length, top_k, kwargs))
        if self.clock is not None:
            self.clock.now += self.score_s
        n = len(token_ids) - prompt_length
        ids = [[self.base + i + r for r in range(top_k)] for i in range(n)]
        lps = [[-0.1 * (r + 1) for r in range(top_k)] for _ in range(n)]
        return ScoreResult(ids, lps, [-5.0] * n)


class TemperatureTeacher(FakeTeacher):
    async def score(self, token_ids, prompt_length, top_k, temperature=1.0):
        return await self._score(token_ids, prompt_length, top_k, temperature=temperature)


class ListSource:
    def __init__(self, rows, waited_s=0.0):
        self.rows = rows
        self.leased = []
        self.released = []
        self.waited_s = waited_s

    def lease(self):
        index = len(self.leased)
        if index >= len(self.rows):
            return None
        lease = PromptLease(index, index, self.rows[index], 0, self.waited_s)
        self.leased.append(lease)
        return lease

    def release(self, lease, reason):
        self.released.append((lease.group_id, reason))


class ListSink:
    def __init__(self):
        self.samples = []
        self.gate = None

    async def put(self, sample):
        if self.gate is not None:
            await self.gate.wait()
        self.samples.append(sample)


def make_args(**overrides):
    """The user's config (a real `AsyncDistillationConfig`: the loop derives its typed settings from it)."""
    values = dict(
        max_completion_length=8, temperature=1.0, teacher_top_k=2, teacher_temperature=1.0, max_inflight_tasks=4
    )
    values.update(overrides)
    return AsyncDistillationConfig(**values)


def user_row(text, **columns):
    return {"prompt": [{"role": "user", "content": text}], **columns}


@pytest.fixture
def fakes():
    """The worker-loop fakes as a namespace."""
    return types.SimpleNamespace(
        Tokenizer=FakeTokenizer,
        Clock=FakeClock,
        Student=FakeStudent,
        Teacher=FakeTeacher,
        TemperatureTeacher=TemperatureTeacher,
        Source=ListSource,
        Sink=ListSink,
        args=make_args,
        row=user_row,
        EOS=EOS,
    )
