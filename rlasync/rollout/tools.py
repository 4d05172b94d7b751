"""Tool calling for the multi-turn rollout loop (docs/algorithms.md §3.1 parsing, §3.2 execution).

    assistant output ids ──parse_response──► {"role": "assistant", "content", "tool_calls"?}
                                                   │ tool_calls (OpenAI shape)
                                                   ▼
                         execute_tool_calls ──► [{"role": "tool", "name", "content"}], counts, metric items

A tool call has the OpenAI shape `{"type": "function", "function": {"name": str, "arguments": dict}}`.

Parsing uses the tokenizer's own `parse_response` when it has a `response_template` (transformers ≥ 5); otherwise,
or when that fails, the Hermes/Qwen format: one or more `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
blocks in the text decoded with special tokens kept (`<tool_call>` may be a special token). A block whose JSON is
malformed gives no call, is counted as a parse failure, and its text stays in the content. Parsing never raises.

Execution runs the calls of one assistant message in the order emitted: coroutine functions are awaited, sync
functions run on the given thread pool (so up to its size of them run at once across rollouts: tools touching
shared state must be thread-safe). With `timeout_s` a call that has not returned in time becomes a tool error
message to the model (`{"error": "tool `<name>` did not return within tool_timeout_s=..."}`), counted as a failure
and in `tools/timeout_count`; a sync tool's thread cannot be killed and keeps its pool slot until it returns.
A `ToolCallTracker` records the calls in flight (the oldest is in the rollout actor's health). Metric names are those of docs/algorithms.md §8.2: counters
`tools/<name>/call_count`, `tools/<name>/failure_count`, `tools/unknown_name_count`, `tools/parse_failure_count`;
rates `tools/latency_s`, `tools/<name>/latency_s`, `tools/parallel_calls_mean`. Nothing here imports ray or torch.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from rlasync.engine.base import RequestRejectedError
from rlasync.records import MetricValue, Rollout, TurnRecord
from rlasync.rewards.calling import hook_name

logger = logging.getLogger(__name__)
_warned_tools: set[str] = set()  # tools whose first exception was logged (once each: the model sees every one)

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)

PARSE_FAILURE_METRIC = "tools/parse_failure_count"
UNKNOWN_NAME_METRIC = "tools/unknown_name_count"
LATENCY_METRIC = "tools/latency_s"
TIMEOUT_METRIC = "tools/timeout_count"
PARALLEL_CALLS_METRIC = "tools/parallel_calls_mean"

Metrics = list[tuple[str, MetricValue]]


@dataclass(slots=True)
class ParsedResponse:
    """One turn's assistant message and how many tool-call blocks could not be parsed."""

    message: dict[str, Any]
    parse_failures: int = 0

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return list(self.message.get("tool_calls") or [])


@dataclass(slots=True)
class ToolResults:
    """What executing one assistant message's tool calls produced."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    num_calls: int = 0
    num_failures: int = 0
    metrics: Metrics = field(default_factory=list)

    def __iter__(self):  # unpacks as (tool_messages, num_calls, num_failures, metrics)
        return iter((self.messages, self.num_calls, self.num_failures, self.metrics))


class ToolCallTracker:
    """The tool calls in flight (name, start time): `oldest()` for the health report."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._calls: dict[int, tuple[str, float]] = {}
        self._next = 0

    def start(self, name: str) -> int:
        token, self._next = self._next, self._next + 1
        self._calls[token] = (name, self._clock())
        return token

    def end(self, token: int) -> None:
        self._calls.pop(token, None)

    def oldest(self) -> dict[str, Any] | None:
        """`{"name", "age_s"}` of the oldest call still running, or None."""
        if not self._calls:
            return None
        name, started = min(self._calls.values(), key=lambda call: call[1])
        return {"name": name, "age_s": self._clock() - started}


def tool_name(tool: Callable[..., Any]) -> str:
    """The name a tool is called by: its `__name__` (a bound method's is the method name)."""
    name = getattr(tool, "__name__", None)
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"tool {tool!r} has no __name__: tools must be named functions (module-level functions or "
            "methods), since the name is what the model calls"
        )
    return name


def tools_by_name(tools: Iterable[Callable[..., Any]] | None) -> dict[str, Callable[..., Any]]:
    """`{name: tool}`; `ValueError` when two tools share a name (the model could not tell them apart)."""
    table: dict[str, Callable[..., Any]] = {}
    for tool in tools or ():
        name = tool_name(tool)
        if name in table and table[name] is not tool:
            raise ValueError(f"two tools are named {name!r}: give every tool a unique __name__")
        table[name] = tool
    return table


# ---- parsing ----------------------------------------------------------------------------------------------


def parse_response(
    tokenizer: Any,
    output_ids: Sequence[int],
    prompt_ids: Sequence[int] | None = None,
    tools: Sequence[Any] | None = None,
) -> ParsedResponse:
    """The assistant message of one turn's output, with `tool_calls` when it called tools.

    The tokenizer's own `parse_response` is used when it has a `response_template`; otherwise (or if that
    fails) the Hermes/Qwen `<tool_call>` blocks are parsed from the decoded text. Never raises.
    """
    if getattr(tokenizer, "response_template", None) is not None and callable(
        getattr(tokenizer, "parse_response", None)
    ):
        try:
            parsed = tokenizer.parse_response(
                list(output_ids), prefix=list(prompt_ids or []), tools=list(tools or []) or None
            )
            return ParsedResponse(_normalise_message(parsed))
        except Exception as exc:  # any template/schema problem: fall back to the text format
            logger.debug(
                "tokenizer.parse_response failed (%s: %s); parsing <tool_call> blocks", type(exc).__name__, exc
            )
    raw = tokenizer.decode(list(output_ids), skip_special_tokens=False)
    if TOOL_CALL_OPEN not in raw:
        return ParsedResponse(
            {"role": "assistant", "content": tokenizer.decode(list(output_ids), skip_special_tokens=True)}
        )
    content, calls, failures = parse_tool_call_text(raw)
    content = _strip_special_tokens(content, tokenizer).strip()
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return ParsedResponse(message, failures)


def parse_tool_call_text(text: str) -> tuple[str, list[dict[str, Any]], int]:
    """`(content, tool_calls, num_parse_failures)` of a Hermes/Qwen-format text.

    Each well-formed `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block becomes a call and is
    removed from the content; a malformed one (bad JSON, no string name, arguments not an object) stays in the
    content and counts as a failure. An opening tag without a closing one (a truncated turn) is a failure too.
    """
    calls: list[dict[str, Any]] = []
    failures = 0
    kept: list[str] = []
    position = 0
    for match in _TOOL_CALL_BLOCK.finditer(text):
        kept.append(text[position : match.start()])
        position = match.end()
        call = _call_from_json(match.group(1))
        if call is None:
            failures += 1
            kept.append(match.group(0))
        else:
            calls.append(call)
    tail = text[position:]
    if TOOL_CALL_OPEN in tail:
        failures += tail.count(TOOL_CALL_OPEN)
    kept.append(tail)
    return "".join(kept), calls, failures


def _call_from_json(body: str) -> dict[str, Any] | None:
    try:
        payload = json.loads(body.strip())
    except (ValueError, TypeError):
        return None
    if not isinstance(payload, Mapping):
        return None
    if isinstance(payload.get("function"), Mapping):  # already OpenAI-shaped
        payload = payload["function"]
    name = payload.get("name")
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, Mapping):
        return None
    return make_tool_call(name, dict(arguments))


def make_tool_call(name: str, arguments: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A tool call in the OpenAI shape."""
    return {"type": "function", "function": {"name": name, "arguments": dict(arguments or {})}}


def _normalise_message(parsed: Any) -> dict[str, Any]:
    """The tokenizer's parsed message as `{"role": "assistant", "content": str, "tool_calls"?: [OpenAI calls]}`."""
    if not isinstance(parsed, Mapping):
        raise TypeError(f"parse_response returned a {type(parsed).__name__}, not a message dict")
    message = dict(parsed)
    message["role"] = "assistant"
    if message.get("content") is None:
        message["content"] = ""
    calls = []
    for call in message.pop("tool_calls", None) or []:
        function = call.get("function", call) if isinstance(call, Mapping) else None
        normalised = _call_from_json(json.dumps(function, default=str)) if function is not None else None
        if normalised is None:
            raise ValueError(f"unparseable tool call {call!r}")
        calls.append(normalised)
    if calls:
        message["tool_calls"] = calls
    return message


def _strip_special_tokens(text: str, tokenizer: Any) -> str:
    specials = [token for token in getattr(tokenizer, "all_special_tokens", None) or [] if token]
    for token in sorted(set(specials), key=len, reverse=True):
        text = text.replace(token, "")
    return text


# ---- execution --------------------------------------------------------------------------------------------


async def execute_tool_calls(
    calls: Sequence[Mapping[str, Any]],
    tools: Mapping[str, Callable[..., Any]],
    executor: Executor | None = None,
    *,
    clock: Callable[[], float] = time.perf_counter,
    timeout_s: float | None = None,
    tracker: ToolCallTracker | None = None,
) -> ToolResults:
    """Run one assistant message's tool calls in the order emitted (docs/algorithms.md §3.2).

    Unknown name → failure, content `str({"error": "unknown tool <name>"})`, no latency. A known tool gets the
    call's `arguments` as keyword arguments: awaited if it is a coroutine function, else run on `executor`
    (`None`: the event loop's default pool). An exception → failure, content `str({"error": str(exc)})`. Each
    call gives one `{"role": "tool", "name": name, "content": str(result)}` message. Returns a `ToolResults`
    (it unpacks as `(tool_messages, num_calls, num_failures, metrics)`). `timeout_s`: see the module docstring.
    """
    results = ToolResults()
    for call in calls:
        function = call.get("function", call) if isinstance(call, Mapping) else {}
        name = str(function.get("name", ""))
        arguments = function.get("arguments") or {}
        results.num_calls += 1
        results.metrics.append((f"tools/{name}/call_count", 1.0))
        tool = tools.get(name)
        if tool is None:
            results.num_failures += 1
            results.metrics += [(UNKNOWN_NAME_METRIC, 1.0), (f"tools/{name}/failure_count", 1.0)]
            results.messages.append(_tool_message(name, {"error": f"unknown tool {name}"}))
            continue
        started = clock()
        token = tracker.start(name) if tracker is not None else None
        try:
            if not isinstance(arguments, Mapping):
                raise TypeError(f"arguments must be an object of named arguments, got {type(arguments).__name__}")
            async with asyncio.timeout(timeout_s):
                result = await call_tool(tool, dict(arguments), executor)
        except TimeoutError:
            results.num_failures += 1
            results.metrics += [(f"tools/{name}/failure_count", 1.0), (TIMEOUT_METRIC, 1.0)]
            result = {"error": f"tool `{name}` did not return within tool_timeout_s={timeout_s:g} s"}
            logger.warning(
                "tool `%s` did not return within tool_timeout_s=%g s: the model gets an error", name, timeout_s
            )
        except Exception as exc:
            results.num_failures += 1
            results.metrics.append((f"tools/{name}/failure_count", 1.0))
            result = {"error": str(exc)}
            if name not in _warned_tools:
                _warned_tools.add(name)
                logger.warning(
                    "tool `%s` (%s) raised %s: %s; the model gets the error as the tool's answer (counted in "
                    "tools/%s/failure_count; this warning is logged once per tool)",
                    name,
                    hook_name(tool),
                    type(exc).__name__,
                    exc,
                    name,
                )
        finally:
            if tracker is not None and token is not None:
                tracker.end(token)
        latency = clock() - started
        results.metrics += [(LATENCY_METRIC, (latency, 1.0)), (f"tools/{name}/latency_s", (latency, 1.0))]
        results.messages.append(_tool_message(name, result))
    if calls:
        results.metrics.append((PARALLEL_CALLS_METRIC, (float(len(calls)), 1.0)))
    return results


async def call_tool(tool: Callable[..., Any], arguments: Mapping[str, Any], executor: Executor | None) -> Any:
    """`tool(**arguments)`: awaited if it is a coroutine function, else run on `executor` (`None`: the event
    loop's default pool) so that a slow sync tool does not block the event loop."""
    if inspect.iscoroutinefunction(tool) or inspect.iscoroutinefunction(type(tool).__call__):
        return await tool(**arguments)
    loop = asyncio.get_running_loop()
    result = await loop.run_in_executor(executor, functools.partial(tool, **arguments))
    if inspect.isawaitable(result):  # a sync wrapper that returned a coroutine
        result = await result
    return result


def _tool_message(name: str, result: Any) -> dict[str, Any]:
    return {"role": "tool", "name": name, "content": str(result)}


async def run_tool_loop(
    prompt: list[dict[str, Any]],
    tools: Sequence[Callable[..., Any]],
    *,
    render: Callable[[list[dict[str, Any]], Sequence[Any]], list[int]],
    generate_one_turn: Callable[[list[int]], Any],
    parse_response: Callable[[list[int], list[int]], dict[str, Any]],
    executor: Callable[[], Executor],
    emit: Callable[[Metrics], Any],
    max_iterations: int | None,
    timeout_s: float | None = None,
    tracker: ToolCallTracker | None = None,
) -> Rollout:
    """The multi-turn tool loop of docs/algorithms.md §3.1 over a policy's hooks (`AsyncRolloutLoop.generate_with_tools`): render
    the conversation, generate a turn, run its tool calls, repeat until an answer without tool calls, after
    `max_iterations` rounds of tool execution (None: unbounded; the rollout then counts in
    `tools/loop_exhausted_frac`), or when a later turn's request is rejected (the conversation outgrew the engine:
    `rollout/context_exhausted_count`; a rejected first turn propagates and fails the group)."""
    table = tools_by_name(tools)
    messages = list(prompt)
    completion: list[dict[str, Any]] = []
    completion_ids: list[int] = []
    turns: list[TurnRecord] = []
    iterations = num_calls = num_failures = 0
    exhausted = False
    while True:
        prompt_ids = render(messages, tools)
        try:
            turn = await generate_one_turn(prompt_ids)
        except RequestRejectedError as exc:
            if not turns:
                raise  # the prompt itself does not fit: the group fails as for a single turn
            logger.debug("conversation ends after %d turns: %s", len(turns), exc)
            emit([("rollout/context_exhausted_count", 1.0)])
            break
        message = parse_response(turn.output_ids, prompt_ids)
        completion.append(message)
        messages.append(message)
        completion_ids += turn.output_ids
        turns.append(turn)
        calls = message.get("tool_calls") or []
        if not calls:
            break
        if max_iterations is not None and iterations >= max_iterations:
            exhausted = True  # the requested tools are not run
            break
        results = await execute_tool_calls(calls, table, executor(), timeout_s=timeout_s, tracker=tracker)
        emit(results.metrics)
        completion += results.messages
        messages += results.messages
        num_calls += results.num_calls
        num_failures += results.num_failures
        iterations += 1
    emit([("tools/loop_exhausted_frac", (float(exhausted), 1.0))])
    return Rollout(completion, completion_ids, turns, tool_call_count=num_calls, tool_failure_count=num_failures)


__all__ = [
    "ParsedResponse",
    "ToolCallTracker",
    "ToolResults",
    "call_tool",
    "execute_tool_calls",
    "make_tool_call",
    "parse_response",
    "parse_tool_call_text",
    "run_tool_loop",
    "tool_name",
    "tools_by_name",
]
