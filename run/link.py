"""run/link.py — the transport beyond one node (remote.py's): a message link and a weight group.

Role: `Link`, one ZMQ DEALER socket a side (pyzmq: vLLM's own dependency), owned by one thread that
sends, receives and heartbeats; `weight_group`, a 2-member torch.distributed group (gloo on CPU,
NCCL on GPUs) on a TCPStore; `send_weights` / `receive_weights` move a packed buffer in buckets over
it. Data contract: messages are pickled tuples (seq, kind, *args) — keep the port inside the
cluster. Each is delivered once or the link ends: ZMQ drops what was queued for a connection that
broke, so every message (heartbeats too) carries its number and a gap ends the link. A dropped
connection not back within RECONNECT_S, silence over `silence_limit(--timeout-s)`, or an `error`
message also end it (`failed` set, `on_fail(why)` called once). Sends never block.
May touch: its socket, its thread, the group it builds, the buffers it is handed.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import zmq
from torch.distributed import ProcessGroupGloo
from zmq.utils.monitor import recv_monitor_message

from config import split_addr

HEARTBEAT_S = 1.0  # a message (a ping if nothing else) at least this often, both ways
# the link thread's loop: how long it waits for a message before looking at its queues again
POLL_MS = 5
# a dropped connection not back within this long ends the link (the peer's process ended)
RECONNECT_S = 3.0
BUCKET_BYTES = 64 * 2**20  # weights cross in views of the packed buffer of at most this size


def silence_limit(timeout_s: float) -> float:
    """How long the other side may stay silent: half of --timeout-s, so the link notices a dead peer
    before any wait on what the peer sends (a rollout group, an engine start) times out on its
    own."""
    return max(3 * HEARTBEAT_S, timeout_s / 2)


# --------------------------------------------------------------------------------------------------
# The link: one ZMQ socket, one thread. Messages are tuples (kind, *args):
#   trainer -> generator node: hello(settings, layout, ...), credit(n),
#       control(stop, interrupted, groups_dropped, steps_skipped, eval_request),
#       weights(version, nbytes: the bytes follow on the weight group), bye
#   generator node -> trainer: welcome(store_port), group(RolloutGroup),
#       state(ready, loaded_version), eval(EvalResult), bye
#   both ways: ping (a heartbeat), error(text: why this side ends; the other side ends too)
# --------------------------------------------------------------------------------------------------
@dataclass
class Wire:
    """The link thread's own state: its socket and the socket's monitor, and what it sent and heard
    when (time.monotonic())."""

    sock: zmq.Socket
    monitor: zmq.Socket
    last_heard: float
    last_sent: float
    pending: tuple | None = None  # the next message, numbered, until the socket takes it
    closing_since: float | None = None  # when `close` was asked
    lost_since: float | None = None  # when the connection dropped (None: connected)
    sent_seq: int = 0  # the number of the last message sent (the first is 1)
    heard_seq: int = 0  # the number of the last message received (-1 after a gap)


class Link:
    """A DEALER socket owned by one thread. Other threads `send`; messages in go to
    `on_message(kind, *args)` and `tick()` runs every POLL_MS, both in the link thread. `fail(text)`
    (the other side's "error", its silence over `timeout_s` once it has spoken, or its connection
    dropped for RECONNECT_S) sets `failed` and calls `on_fail(text)` once. Sends never block: with
    no peer connected a message waits its turn."""

    def __init__(
        self, addr: str, bind: bool, timeout_s: float, on_message, tick=lambda: None, on_fail=print
    ):
        self.addr, self.bind, self.timeout_s = addr, bind, timeout_s
        self.on_message, self.tick, self.on_fail = on_message, tick, on_fail
        self.out: queue.Queue = queue.Queue()
        self.failed = threading.Event()  # set once, by `fail`
        self.closed = threading.Event()  # set by `close`
        self.heard = threading.Event()  # the other side has spoken
        self.watching = True  # silence counts as a failure (off once this side asked to stop)
        self.error = ""
        self.thread = threading.Thread(target=self._run, name="link", daemon=True)
        self.thread.start()

    def send(self, *message) -> None:
        self.out.put(message)

    def fail(self, text: str) -> None:
        if not self.failed.is_set():
            self.error = text
            self.failed.set()
            self.on_fail(text)

    def close(self, *last_message) -> None:
        """Send `last_message` (if any) and whatever is queued (for 2 s at most), then close the
        socket."""
        if last_message:
            self.send(*last_message)
        self.closed.set()
        self.thread.join(timeout=5)

    def _run(self):
        """The link thread: tick, send what is queued, heartbeat, receive, watch the peer; until
        `close` (then what is queued still goes out, for 2 s at most)."""
        context = zmq.Context()
        wire = self._open(context)
        try:
            while True:
                if self.closed.is_set() and wire.closing_since is None:
                    wire.closing_since = time.monotonic()
                try:
                    self.tick()
                except Exception as err:  # a bug of ours on this side: end like any other failure
                    self.fail(f"link error on this side: {err!r}")
                self._send_queued(wire)
                if wire.closing_since is not None and (
                    wire.pending is None or time.monotonic() - wire.closing_since > 2
                ):
                    return
                self._heartbeat(wire)
                if wire.sock.poll(POLL_MS):
                    self._receive(wire)
                self._watch_peer(wire)
        finally:
            wire.sock.disable_monitor()
            wire.monitor.close()
            wire.sock.close()
            context.term()

    def _open(self, context) -> Wire:
        """The socket, bound or connected to `addr`, and its monitor."""
        sock = context.socket(zmq.DEALER)
        sock.linger = 2000  # ms: what is queued at close still goes out (an error, a bye)
        host, port = split_addr(self.addr)
        if self.bind:
            sock.bind(f"tcp://{host}:{port}")
        else:
            sock.connect(f"tcp://{host}:{port}")
        # TCP tells at once when the peer's process ends (its
        # kernel closes the connection); silence covers the rest.
        monitor = sock.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
        )
        now = time.monotonic()
        return Wire(sock, monitor, last_heard=now, last_sent=now)

    def _send_queued(self, wire: Wire) -> None:
        """Hand the socket every queued message, numbered, until it would block: with no peer
        connected (yet, or any more) a message waits in `pending`."""
        while True:
            if wire.pending is None:
                try:
                    wire.pending = (wire.sent_seq + 1, *self.out.get_nowait())
                except queue.Empty:
                    return
            try:
                wire.sock.send_pyobj(wire.pending, zmq.NOBLOCK)
            except zmq.Again:
                return
            wire.sent_seq, wire.pending = wire.pending[0], None
            wire.last_sent = time.monotonic()

    def _heartbeat(self, wire: Wire) -> None:
        """A numbered ping where nothing went out for HEARTBEAT_S."""
        if time.monotonic() - wire.last_sent > HEARTBEAT_S:
            try:
                wire.sock.send_pyobj((wire.sent_seq + 1, "ping"), zmq.NOBLOCK)
                wire.last_sent, wire.sent_seq = time.monotonic(), wire.sent_seq + 1
            except zmq.Again:
                pass

    def _receive(self, wire: Wire) -> None:
        """Every message waiting: to `on_message`, an "error" to `fail`; a gap in the numbers
        fails the link, and nothing after it is delivered."""
        while wire.sock.poll(0):
            seq, kind, *args = wire.sock.recv_pyobj()
            wire.last_heard = time.monotonic()
            self.heard.set()
            # Nothing after a gap is trusted: a group, a credit or a weights header is gone.
            if seq != wire.heard_seq + 1:
                self.fail(
                    f"lost {seq - wire.heard_seq - 1} message(s) across a reconnect (message {seq} "
                    f"came after {wire.heard_seq}): the run cannot continue consistently"
                )
                wire.heard_seq = -1  # every later message is a gap too
            elif wire.heard_seq >= 0:
                wire.heard_seq = seq
            if wire.heard_seq < 0:
                continue
            if kind == "error":
                self.fail(args[0])
            elif kind != "ping":
                self.on_message(kind, *args)

    def _watch_peer(self, wire: Wire) -> None:
        """Note the connection's drops and returns; once the peer has spoken (and while `watching`),
        fail on its silence over `timeout_s` or on its connection dropped for RECONNECT_S."""
        while wire.monitor.poll(0):
            event = recv_monitor_message(wire.monitor)["event"]
            wire.lost_since = time.monotonic() if event == zmq.EVENT_DISCONNECTED else None
        if not (self.watching and self.heard.is_set()):
            return
        silent = time.monotonic() - wire.last_heard
        if silent > self.timeout_s:
            self.fail(f"sent nothing for {silent:.0f} s (half of --timeout-s): is it alive?")
        if wire.lost_since and time.monotonic() - wire.lost_since > RECONNECT_S:
            self.fail(
                f"closed the connection and did not come back within {RECONNECT_S:.0f} s: "
                "its process ended"
            )


def weight_group(store, rank: int, device: torch.device, timeout_s: float):
    """The 2-member group the weights cross (rank 0: trainer rank 0, rank 1: the generator node),
    built on `store` without touching the default process group: gloo for CPU tensors, NCCL for CUDA
    ones."""
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":  # not run here (no GPUs): the same shape as the gloo group
        from torch.distributed import ProcessGroupNCCL  # only CUDA builds of torch have it

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(store, rank, 2, options)
    return ProcessGroupGloo(store, rank, 2, timeout)


def buckets(flat: torch.Tensor, size: int = BUCKET_BYTES) -> list[torch.Tensor]:
    """Views of a flat tensor's bytes, each at most `size` bytes."""
    raw = flat.view(torch.uint8)
    return [raw[i : i + size] for i in range(0, raw.numel(), size)]


def send_weights(group, flat: torch.Tensor, bucket_bytes: int = BUCKET_BYTES) -> None:
    for chunk in buckets(flat, bucket_bytes):
        group.send([chunk], 1, 0).wait()


def receive_weights(group, shared, version: int, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Receive one publish straight into `shared` (a shared_weights.SharedWeights) and publish it
    there as `version`."""
    shared.begin_write()
    for chunk in buckets(shared.buffer, bucket_bytes):
        group.recv([chunk], 0, 0).wait()
    shared.end_write(version)
