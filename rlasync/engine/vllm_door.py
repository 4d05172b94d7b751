"""A weight sync that reaches vLLM's worker without its front end: `VLLMEngine(direct_sync=True)`.

Every call into an in-process vLLM's worker (`AsyncLLM.collective_rpc`) crosses the front end's event loop twice:
out, behind the loop's processing of every step's outputs, and back. On short GRPO completions that loop is the
busiest part of the generation actor's process, and the two crossings were most of a vLLM weight sync (SmolLM2 sums
run, two engines on one H100: pause 36 ms and dispatch 20 ms at the median of a 65 ms sync).

The door is a Unix socket the worker listens on (`SyncDoor`, opened once through one `collective_rpc`). A sync from
learner rank 0's persistent buckets is one message through it (`DoorClient.send_load`, from the generation actor's
own sync thread); a thread in the worker process receives it and leaves it pending; the worker applies it at the
start of its next `execute_model` (the door wraps that method on the worker instance), so it lands between two steps
on the stream the steps run on: no step reads half of each set of weights. The worker answers through the socket
(`DoorClient.wait`) once the copies are queued with the sender's event recorded behind them (done, without one). When the engine is idle no step comes: the client also sends `apply_sync_door` through the
front end (not awaited), which vLLM's EngineCore runs between steps or at once when idle, and which applies whatever
is pending; whichever comes first applies the load, the other finds nothing.

This module imports neither vllm nor ray; the socket protocol is stdlib only (length-prefixed pickles, on a socket
file in a directory only this user can enter).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!Q")


def send_message(sock: socket.socket, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv_message(sock: socket.socket) -> Any:
    """The next message, or None once the peer closed the socket."""
    header = _recv_exactly(sock, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    data = _recv_exactly(sock, size)
    if data is None:
        raise ConnectionError("the sync door's peer closed the socket mid-message")
    return pickle.loads(data)


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            if left == size:
                return None
            raise ConnectionError("the sync door's peer closed the socket mid-message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class _Pending:
    __slots__ = ("request", "conn", "arrived")

    def __init__(self, request: dict[str, Any], conn: socket.socket) -> None:
        self.request, self.conn, self.arrived = request, conn, time.perf_counter()


class SyncDoor:
    """The worker's side: a listening socket, a thread per connection that receives loads and leaves them pending,
    and `apply_pending` (called from the worker's own thread, between steps) that applies them and answers.

    `apply(request)` does the load (the worker's `load_flat_ipc`) and returns its result dict; the answer is
    `{"seq", "ok", "result" | "error", "waited_s" (arrival until applied), "applied_by" ("step" or "nudge")}`."""

    def __init__(self, apply: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self._apply = apply
        self._folder = tempfile.mkdtemp(prefix="rlasync-door-")
        os.chmod(self._folder, 0o700)  # only this user may connect
        self.path = os.path.join(self._folder, "door.sock")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        self._server.listen(4)
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._pending: list[_Pending] = []
        self._received = 0  # the largest sequence number received
        self._closed = False
        threading.Thread(target=self._accept, name="rlasync-sync-door", daemon=True).start()
        atexit.register(self.close)  # the socket's folder goes with the worker's process (a clean exit)

    def has_pending(self) -> bool:
        return bool(self._pending)  # a read without the lock: an empty list is the common case, checked every step

    def wait_received(self, seq: int, timeout_s: float) -> bool:
        """Wait until load `seq` has been received (a nudge may overtake the load it follows); False on timeout."""
        with self._arrived:
            return self._arrived.wait_for(lambda: self._received >= seq or self._closed, timeout_s)

    def apply_pending(self, applied_by: str) -> int:
        """Apply every pending load in arrival order and answer each; returns how many."""
        with self._lock:
            pending, self._pending = self._pending, []
        for item in pending:
            started = time.perf_counter()
            try:
                answer = {"ok": True, "result": self._apply(item.request)}
            except Exception as exc:  # noqa: BLE001 - answered to the client, which falls back
                logger.warning("a weight load through the sync door failed: %s: %s", type(exc).__name__, exc)
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            answer.update(seq=item.request.get("seq"), waited_s=started - item.arrived, applied_by=applied_by)
            try:
                send_message(item.conn, answer)
            except OSError as exc:  # the client went away: it times out or reconnects
                logger.warning("the sync door could not answer a load: %s", exc)
        return len(pending)

    def close(self) -> None:
        atexit.unregister(self.close)
        with self._arrived:
            self._closed = True
            self._arrived.notify_all()
        with contextlib.suppress(OSError):
            self._server.close()
        shutil.rmtree(self._folder, ignore_errors=True)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._receive, args=(conn,), name="rlasync-sync-door-conn", daemon=True).start()

    def _receive(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    request = recv_message(conn)
                except (OSError, pickle.UnpicklingError) as exc:  # ConnectionError is an OSError
                    logger.warning("the sync door dropped a connection: %s", exc)
                    return
                if request is None:
                    return
                with self._arrived:
                    self._pending.append(_Pending(request, conn))
                    self._received = max(self._received, int(request.get("seq", 0)))
                    self._arrived.notify_all()


def install_door(worker: Any, apply: Callable[[dict[str, Any]], dict[str, Any]]) -> SyncDoor:
    """Open a `SyncDoor` for `worker` and wrap its `execute_model` (on the instance: vLLM's worker wrapper calls
    `worker.execute_model(...)`) so a pending load is applied before the step it would otherwise run beside."""
    door = SyncDoor(apply)
    step = worker.execute_model

    def execute_model(*args: Any, **kwargs: Any) -> Any:
        if door.has_pending():
            door.apply_pending("step")
        return step(*args, **kwargs)

    worker.execute_model = execute_model
    return door


def remove_door(worker: Any, door: SyncDoor) -> None:
    """Close `door` and unwrap the worker's `execute_model` (the wrapper is an instance attribute over the class's)."""
    worker.__dict__.pop("execute_model", None)
    door.close()


class DoorClient:
    """The engine's side: one connection to the worker's door, used from one thread at a time (the generation
    actor's sync thread). Blocking: a sync waits for its answer anyway, and a thread of its own avoids the event
    loop the front end keeps busy."""

    def __init__(self, path: str, timeout_s: float) -> None:
        self.path, self.timeout_s = path, float(timeout_s)
        self._sock: socket.socket | None = None
        self._seq = 0
        self._lock = threading.Lock()

    def send_load(self, key: str, buckets: Any, event: bytes | None = None) -> int:
        """Send one load (`load_flat_ipc`'s arguments); returns its sequence number for `wait` (and the nudge)."""
        with self._lock:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout_s)
                sock.connect(self.path)
                self._sock = sock
            self._seq += 1
            send_message(self._sock, {"seq": self._seq, "key": key, "buckets": buckets, "event": event})
            return self._seq

    def wait(self, seq: int) -> dict[str, Any]:
        """The worker's answer to load `seq` (`SyncDoor`'s answer dict); `TimeoutError` after `timeout_s`."""
        sock = self._sock
        if sock is None:
            raise ConnectionError("the sync door is not connected")
        while True:
            try:
                answer = recv_message(sock)
            except TimeoutError as exc:
                self.close()  # a late answer must not be read as the next load's
                raise TimeoutError(f"vLLM's worker did not apply a weight load within {self.timeout_s:.0f} s") from exc
            if answer is None:
                self.close()
                raise ConnectionError("vLLM's worker closed the sync door")
            if answer.get("seq") == seq:
                return answer

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.close()
                self._sock = None
