"""run/remote.py — beyond one node: the generator on its own machine, the trainer ranks under
torchrun.

Role: `--role generator` runs the ordinary generator (processes.run_children) behind a bridge to a
trainer (remote_generator.py); `--role trainer` is one torchrun rank, rank 0 holding the link
(link.py: ZMQ messages; weights over a 2-member gloo/NCCL group on a TCPStore at PORT + 1).
Contract: the one-node RolloutGroups, version tags and staleness gate; at most --queue-size finished
groups not yet taken (1 in the node's queue + queue_size - 1 credits, one granted back per group
taken). A publish is gathered on every rank, then rank 0 sends it in buckets into the node's packed
buffer (begin_write .. end_write: vLLM loads it as today). Either side ending ends the other,
non-zero; the trainer checkpoints as it does when a process fails on one node. May touch: its link
and group, the generator node's buffer, queue and Control.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from config import split_addr
from generator.shared_weights import copy_into_slots, packed_numel
from infra import devices, processes
from run import metrics, prepare
from run.link import Link, send_weights, silence_limit, weight_group


# --------------------------------------------------------------------------------------------------
# The trainer's side (torchrun ranks; rank 0 holds the link)
# --------------------------------------------------------------------------------------------------
class Counter:
    """An mp.Value look-alike for threads: `.value`, `.get_lock()`."""

    def __init__(self, value=0):
        self.value, self._lock = value, threading.Lock()

    def get_lock(self):
        return self._lock


class Pair(list):
    """An mp.Array look-alike for threads (evaluation.request writes [step, version] under its
    lock)."""

    def __init__(self, values):
        super().__init__(values)
        self._lock = threading.Lock()

    def get_lock(self):
        return self._lock


def thread_control():
    """A processes.Control built from threading primitives (what trainer_main reads on a torchrun
    rank)."""
    return processes.Control(
        stop=threading.Event(),
        ready=threading.Event(),
        engine_started=threading.Event(),
        groups_dropped=Counter(),
        steps_skipped=Counter(),
        loaded_version=Counter(),
        interrupted=threading.Event(),
        eval_request=Pair([-1, 0]),
        eval_results=queue.Queue(),
        saving=Counter(),
    )


class RemoteWeights:
    """What trainer ranks publish into with a remote role: the packed buffer's writer methods, a
    single writer (sync.publish_model gathers the parameters on every rank, rank 0 alone writes). On
    rank 0 a local packed buffer in the serving dtype, sent to the generator node by `end_write`; on
    other ranks only the layout."""

    device_type = "remote"
    single_writer = True
    starts_empty = True  # the generator node serves nothing until the first publish reaches it

    def __init__(self, layout, dtype, trainer_link: "TrainerLink | None" = None, device="cpu"):
        self.layout, self.dtype, self.link = layout, dtype, trainer_link
        self.buffer = (
            None
            if trainer_link is None
            else torch.empty(packed_numel(layout), dtype=dtype, device=device)
        )

    @property
    def nbytes(self) -> int:
        return sum(slot.numel for slot in self.layout) * self.dtype.itemsize

    def begin_write(self) -> None:
        pass

    def write_param(self, slot, value, row_start: int = 0) -> None:
        self.buffer[slot.offset : slot.offset + slot.numel].view(slot.shape).copy_(value.detach())

    def write_params(self, slots, values, row_starts) -> None:
        """sync.publish_model's batched writes (rank 0): the packed buffer's own copy
        (shared_weights.copy_into_slots)."""
        copy_into_slots(self.buffer, slots, values, row_starts)

    def end_write(self, version: int) -> None:
        """Send the publish to the generator node (rank 0, once every rank has gathered: nothing
        interleaves with the sends)."""
        self.link.send_weights(version, self.buffer)


class TrainerLink:
    """Trainer rank 0's end: a Control and a rollout queue for trainer_main, backed by the link."""

    def __init__(self, cfg):
        self.addr, self.cfg = cfg.generator_addr, cfg
        self.control = thread_control()
        self.groups: queue.Queue = queue.Queue()
        self.welcome: queue.Queue = queue.Queue()
        self.connected = False
        self.held_max = 0  # the most groups arrived and not yet taken (the bound: queue_size - 1)
        self.send_ms = None  # how long the last publish took to send (ms)
        self.sent_state = None
        self.group = None
        self.link = Link(
            self.addr, False, silence_limit(cfg.timeout_s), self.on_message, self.tick, self.on_fail
        )

    def on_fail(self, text: str) -> None:
        print(f"error: the generator at {self.addr} {text}", file=sys.stderr, flush=True)
        self.control.stop.set()  # every rank leaves the loop together and checkpoints

    def on_message(self, kind, *args) -> None:
        c = self.control
        if kind == "group":
            self.groups.put(args[0])
            self.held_max = max(self.held_max, self.groups.qsize())
        elif kind == "state":
            if args[0]["ready"]:
                c.ready.set()
            c.loaded_version.value = args[0]["loaded_version"]
        elif kind == "eval":
            c.eval_results.put(args[0])
        elif kind == "welcome":
            self.welcome.put(args[0])
            self.connected = True
        elif kind == "bye" and not c.stop.is_set():
            self.link.fail("exited before the trainer finished")

    def tick(self) -> None:
        c = self.control
        if not self.connected:  # the hello carries the state until the generator node has answered
            return
        with c.eval_request.get_lock():
            request = tuple(c.eval_request)
        state = dict(
            stop=c.stop.is_set(),
            interrupted=c.interrupted.is_set(),
            groups_dropped=c.groups_dropped.value,
            steps_skipped=c.steps_skipped.value,
            eval_request=request,
        )
        if state != self.sent_state:
            self.link.send("control", state)
            self.sent_state = state
        if c.stop.is_set():
            self.link.watching = False  # we stop: the generator node going quiet is expected now

    def get(self, timeout=None):
        """buffer.take_groups' queue: each group taken grants the generator node one credit back."""
        group = self.groups.get(timeout=timeout)
        self.link.send("credit", 1)
        return group

    def metrics(self) -> dict:
        return {"remote_groups_held_max": self.held_max, "sync_send_ms": self.send_ms}

    def handshake(self, settings, shapes, dtype: torch.dtype, device: torch.device) -> bool:
        """Send the generator its settings and the weight layout; join the weight group. False:
        failed (the line is printed)."""
        hub_id = prepare.hub_id_of(self.cfg.model)
        self.link.send(
            "hello",
            dict(
                settings=settings,
                shapes=shapes,
                dtype=str(dtype).removeprefix("torch."),
                hub_id=hub_id,
                groups_dropped=self.control.groups_dropped.value,
                steps_skipped=self.control.steps_skipped.value,
                credits=self.cfg.queue_size - 1,
                timeout_s=self.cfg.timeout_s,
            ),
        )
        deadline = time.monotonic() + self.cfg.timeout_s
        while not self.link.failed.is_set():
            try:
                welcome = self.welcome.get(timeout=0.2)
                break
            except queue.Empty:
                if time.monotonic() > deadline:
                    self.link.fail(
                        f"did not answer within {self.cfg.timeout_s:.0f} s (--timeout-s): start "
                        "`train.py --role generator` there first"
                    )
                if self.control.stop.is_set():
                    return False
        else:
            return False
        host, _ = split_addr(self.addr)
        store = TCPStore(
            host, welcome["store_port"], 2, False, timedelta(seconds=self.cfg.timeout_s)
        )
        self.group = weight_group(store, 0, device, self.cfg.timeout_s)
        return True

    def send_weights(self, version: int, flat: torch.Tensor) -> None:
        if self.link.failed.is_set():
            return  # the run is stopping: trainer_main checkpoints
        t0 = time.perf_counter()
        self.link.send("weights", version, flat.numel() * flat.element_size())
        try:
            send_weights(self.group, flat)
        except Exception as err:
            self.link.fail(f"stopped receiving weights ({err})")
            return
        self.send_ms = (time.perf_counter() - t0) * 1e3

    def close(self, *last_message) -> None:
        self.link.watching = False
        self.link.close(*last_message)


def run_trainer(cfg, trainer_main) -> int:
    """One torchrun rank of `train.py --role trainer`, training with `trainer_main`
    (train.trainer_main, handed in by train.main: this module does not import train.py). Returns its
    exit code: 1 when the generator failed (after the checkpoint), 128 + the signal when rank 0 was
    stopped by one. Ctrl-C (or SIGTERM, which torchrun forwards to every rank) is rank 0's to
    handle: it stops after the current step and every rank writes the checkpoint together; the
    other ranks ignore both signals meanwhile. torchrun itself then exits 1 with its own traceback,
    and SIGKILLs ranks still alive 30 s after it forwarded the signal."""
    # every rank: torchrun started them, not a parent of ours
    metrics.configure_terminal(cfg.log_level)
    cfg, place = join_torchrun(cfg)
    trainer_link = TrainerLink(cfg) if place.rank == 0 else None
    control = trainer_link.control if place.rank == 0 else thread_control()
    caught = handle_signals(place.rank, control)
    agreed = agree_on_the_run(cfg, place, trainer_link, control)
    if agreed is None:  # the handshake failed (printed on rank 0)
        dist.destroy_process_group()
        if place.rank == 0:
            trainer_link.close("error", "gave up before training started")
        return 1
    prepared, cfg, layout = agreed
    weights = RemoteWeights(layout, devices.torch_dtype(cfg.dtype), trainer_link, place.device)
    try:
        trainer_main(
            cfg=cfg,
            prepared=prepared,
            rank=place.rank,
            world_size=place.world_size,
            shared=weights,
            rollout_queue=trainer_link,
            control=control,
            init_file="",
        )
    except BaseException as err:
        if place.rank == 0:
            trainer_link.close("error", f"failed: {type(err).__name__}: {err}")
        raise
    if place.rank == 0:
        trainer_link.close("bye")
    if place.rank == 0 and trainer_link.link.failed.is_set():
        return 1
    return 128 + caught[0] if caught else 0


@dataclasses.dataclass(frozen=True)
class TorchrunPlace:
    """Where this process runs under torchrun: its rank of `world_size`, and its device."""

    rank: int
    world_size: int
    device: torch.device


def join_torchrun(cfg) -> tuple:
    """Join the ranks' default process group (torchrun's environment says where); returns the
    run's config with the ranks, dtype and threads this placement gives, and the TorchrunPlace."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_size = (
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
    )
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
        init_method="env://",
        timeout=timedelta(seconds=cfg.timeout_s + 60),
    )
    dtype = (
        devices.GPU_DEFAULT_DTYPE if device.type == "cuda" and cfg.dtype == "auto" else cfg.dtype
    )
    cfg = dataclasses.replace(
        cfg,
        train_ranks=world_size,
        dtype=dtype,
        train_threads=cfg.train_threads or max(1, len(os.sched_getaffinity(0)) // local_size),
    )
    return cfg, TorchrunPlace(rank, world_size, device)


def handle_signals(rank: int, control) -> list[int]:
    """A stop with a checkpoint, as on one node: torchrun sends SIGTERM (and a terminal SIGINT) to
    every rank, and rank 0 decides what it means (the first stops the run after the current step;
    the other ranks follow rank 0 through it and ignore both signals). Returns the signals rank 0
    caught, as they come."""
    caught = []
    if rank != 0:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        return caught

    def on_signal(signum, frame):
        # a second Ctrl-C stops now; more SIGTERMs (SLURM signals every process) are one stop
        if caught:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        caught.append(signum)
        print(
            f"\n{signal.Signals(signum).name}: stopping after the current step "
            "and writing a checkpoint",
            file=sys.stderr,
            flush=True,
        )
        control.interrupted.set()
        control.stop.set()

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    return caught


def agree_on_the_run(cfg, place: TorchrunPlace, trainer_link, control) -> tuple | None:
    """Rank 0 prepares the run and hands the generator node its settings; every rank gets the
    outcome: (the prepared run, the resolved config, the weight layout), or None when the handshake
    failed."""
    box = [None]
    if place.rank == 0:
        try:
            cfg = prepare.resolve(cfg)
            prepared = prepare.prepare_run(cfg, engine_here=False)
            shared = prepare.allocate_shared_weights(
                prepared.model_path, "meta", devices.torch_dtype(cfg.dtype)
            )
            # vLLM starts from the original model; the weights it
            # serves (a checkpoint's too) are the ones we send.
            settings = prepare.generator_settings(
                cfg, dataclasses.replace(prepared, model_path=prepared.base_model)
            )
            control.groups_dropped.value = prepared.groups_dropped
            control.steps_skipped.value = prepared.start_step - prepared.start_version
            ok = trainer_link.handshake(
                settings, [(s.name, s.shape) for s in shared.layout], shared.dtype, place.device
            )
            box = [(prepared, cfg, shared.layout) if ok else None]
        except BaseException:
            dist.broadcast_object_list([None], src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    return box[0]
