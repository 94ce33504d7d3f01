"""run/remote_generator.py — `--role generator`: the generator on its own machine, bridged to a
trainer.

Role: runs the ordinary generator (rollout.generator_main under processes.run_children) behind a
`GeneratorBridge` to the trainer's rank 0 (remote.py holds the trainer's side and the contract of
the two roles): the bridge hands the node's finished groups to the link as credits allow, loads
each publish the trainer sends into the node's packed buffer (vLLM loads it as on one node), and
reports the engine's state. Either side ending ends the other, non-zero.
May touch: its link and weight group, the generator node's buffer, queue and Control.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.multiprocessing as mp
from torch.distributed import TCPStore

from config import split_addr
from generator.shared_weights import SharedWeights, make_layout, packed_numel
from infra import devices, processes
from infra.devices import engine_problems
from rollout import generator_main
from run import metrics, prepare
from run.link import Link, receive_weights, silence_limit, weight_group
from tasks import envs
from tasks.datasets import DataError


class GeneratorBridge:
    """The generator node's parent: mirrors groups out (while holding credits), control in, state
    and evaluation answers out, weights in (a thread receiving into the local packed buffer)."""

    def __init__(self, cfg):
        self.addr, self.timeout_s = cfg.generator_addr, cfg.timeout_s
        self.hello: queue.Queue = queue.Queue()
        self.weights: queue.Queue = queue.Queue()
        self.control = self.rollout_queue = self.shared = self.group = None
        self.credits, self.sent_state, self.trainer_done = 0, None, False
        self.link = Link(
            self.addr, True, silence_limit(cfg.timeout_s), self.on_message, self.tick, self.on_fail
        )

    def on_fail(self, text: str) -> None:
        print(f"error: the trainer at {self.addr} {text}", file=sys.stderr, flush=True)
        if self.control is not None:
            self.control.stop.set()

    def on_message(self, kind, *args) -> None:
        if kind == "hello":
            self.hello.put(args[0])
        elif kind == "credit":
            self.credits += args[0]
        elif kind == "weights":
            self.weights.put(args)
        elif kind == "control" and self.control is not None:
            c, state = self.control, args[0]
            with c.groups_dropped.get_lock():
                c.groups_dropped.value = state["groups_dropped"]
            c.steps_skipped.value = state["steps_skipped"]
            with c.eval_request.get_lock():
                c.eval_request[0], c.eval_request[1] = state["eval_request"]
            if state["interrupted"]:
                c.interrupted.set()
            if state["stop"]:
                self.trainer_done = True
                self.link.watching = False
                c.stop.set()
        elif kind == "bye":
            self.trainer_done = True
            self.link.watching = False
            if self.control is not None:
                self.control.stop.set()

    def tick(self) -> None:
        c = self.control
        if c is None:
            return
        while self.credits > 0:
            try:
                group = self.rollout_queue.get_nowait()
            except queue.Empty:
                break
            self.link.send("group", group)
            self.credits -= 1
        while True:
            try:
                self.link.send("eval", c.eval_results.get_nowait())
            except queue.Empty:
                break
        state = dict(ready=c.ready.is_set(), loaded_version=c.loaded_version.value)
        if state != self.sent_state:
            self.link.send("state", state)
            self.sent_state = state

    def receive(self) -> None:
        """The weights thread: each header announces one publish; its bytes follow on the weight
        group."""
        while not self.link.closed.is_set() and not self.link.failed.is_set():
            try:
                version, nbytes = self.weights.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                if nbytes != self.shared.nbytes:
                    raise ValueError(
                        f"a publish of {nbytes} bytes for a buffer of {self.shared.nbytes}"
                    )
                receive_weights(self.group, self.shared, version)
            except Exception as err:
                if not self.trainer_done:
                    self.link.fail(f"stopped sending weights ({err})")
                return


def generator_placement(cfg, buffer_nbytes: int) -> tuple[dict, str]:
    """This node's own GeneratorSettings placement fields and the packed buffer's device. The buffer
    is on vLLM's first GPU, allocated before vLLM starts: vLLM's share leaves it room
    (devices.DeviceError if none)."""
    gen = devices.parse_devices(cfg.gen_devices, "--gen-devices")
    if gen and devices.cuda_device_count():
        names = devices.visible_tokens(
            devices.cuda_device_count(), os.environ.get("CUDA_VISIBLE_DEVICES")
        )
        share = devices.generator_share_beside_buffer(
            cfg.gpu_memory_utilization, devices.gpu_fraction(buffer_nbytes, f"cuda:{gen[0]}")
        )
        return dict(
            device="cuda",
            cuda_visible_devices=",".join(names[d] for d in gen),
            gpu_memory_utilization=share,
            tensor_parallel_size=len(gen),
        ), f"cuda:{gen[0]}"
    return dict(device="cpu", cuda_visible_devices="", tensor_parallel_size=1), "cpu"


def run_generator(cfg) -> int:
    """`train.py --role generator`: wait for a trainer, then serve it until it stops. Returns the
    exit code."""
    metrics.configure_terminal(cfg.log_level)
    bridge = GeneratorBridge(cfg)
    hello = wait_for_trainer(cfg, bridge)
    if hello is None:  # why is printed
        bridge.link.close()
        return 1
    settings, buffer_device, problem = node_settings(cfg, hello)
    if problem:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        bridge.link.close("error", f"cannot serve: {problem}")
        return 1
    ctx, errors, control = join_trainer(cfg, bridge, hello, buffer_device)
    reports = []
    print(f"generator node: serving the trainer at {cfg.generator_addr}", flush=True)
    generator = (generator_main, (settings, bridge.shared, bridge.rollout_queue, control), True)
    code = processes.run_children(
        ctx,
        {"generator": generator},
        errors,
        control,
        failed=bridge.link.failed,
        on_failure=reports.append,
    )
    if bridge.link.failed.is_set():
        bridge.link.close()
        return 1
    if code != 0 and not bridge.trainer_done:
        why = reports[0] if reports else f"the generator node stopped (exit code {code})"
        bridge.link.close("error", f"failed:\n{why}")
        return code
    bridge.link.close("bye")
    return code


def wait_for_trainer(cfg, bridge: GeneratorBridge) -> dict | None:
    """The trainer's hello (its settings, the weights' layout, the run's counters), or None once
    the link failed, or no trainer connected within --timeout-s (the line printed either way). A
    trainer that has connected may take longer to send its hello: its rank 0 prepares the model."""
    print(
        f"generator node: waiting up to {cfg.timeout_s:.0f} s "
        f"for a trainer on {cfg.generator_addr}",
        flush=True,
    )
    deadline = time.monotonic() + cfg.timeout_s
    while True:
        try:
            return bridge.hello.get(timeout=0.5)
        except queue.Empty:
            if bridge.link.failed.is_set():  # the bridge's on_fail printed why
                return None
            if not bridge.link.heard.is_set() and time.monotonic() > deadline:
                print(
                    f"error: no trainer connected to {cfg.generator_addr} within "
                    f"{cfg.timeout_s:.0f} s (--timeout-s)",
                    file=sys.stderr,
                    flush=True,
                )
                return None


def node_settings(cfg, hello: dict) -> tuple:
    """The trainer's GeneratorSettings as this node runs them: its own devices and threads, a model
    directory on this machine. Returns them, the packed buffer's device, and what keeps this node
    from serving ("": nothing): a placement refused, a model it cannot find, an engine or an --env
    it cannot run."""
    problem = ""
    buffer_nbytes = (
        packed_numel(make_layout(hello["shapes"])) * getattr(torch, hello["dtype"]).itemsize
    )
    try:
        placement, buffer_device = generator_placement(cfg, buffer_nbytes)
    except devices.DeviceError as err:  # refused in one line, with the CPU placement meanwhile
        (placement, buffer_device), problem = (
            generator_placement(dataclasses.replace(cfg, gen_devices=""), 0),
            str(err),
        )
    settings = hello["settings"]  # the trainer's config; this node's own devices and threads
    threads = cfg.gen_threads or max(1, len(os.sched_getaffinity(0)))
    settings = dataclasses.replace(
        settings, cfg=dataclasses.replace(settings.cfg, gen_threads=threads), **placement
    )
    if not problem:
        settings, problem = with_local_model(settings, hello["hub_id"])
    if not problem:
        problem = "; ".join(serving_problems(settings, on_gpu=placement["device"] == "cuda"))
    return settings, buffer_device, problem


def with_local_model(settings, hub_id: str) -> tuple:
    """`settings` with a model directory this machine has, and the problem ("": none). The
    trainer's --model may be a directory in its own hub cache: a hub id is downloaded here."""
    if not os.path.isdir(settings.model) and hub_id:
        try:
            settings = dataclasses.replace(settings, model=prepare.resolve_model(hub_id))
        except DataError as err:
            return settings, str(err)
    if not os.path.isdir(settings.model):
        return settings, (
            f"the trainer's model directory {settings.model} does not exist on this machine: put "
            "--out (and --model) on a filesystem both nodes share, or give --model a "
            "Hugging Face hub id"
        )
    return settings, ""


def serving_problems(settings, on_gpu: bool) -> list[str]:
    """What keeps this node's engine from serving the model, and the --env from loading here
    (episodes run on the generator node)."""
    run = settings.cfg
    engine = engine_problems(
        model_path=settings.model,
        on_gpu=on_gpu,
        max_model_len=run.max_model_len,
        max_new_tokens=run.max_new_tokens,
        kv_cache_mb=run.kv_cache_mb,
        dtype=run.dtype,
        lora_rank=run.lora_rank,
    )
    return engine + [f"on the generator node: {p}" for p in envs.check(run)]


def join_trainer(cfg, bridge: GeneratorBridge, hello: dict, buffer_device: str) -> tuple:
    """Make ready to serve the trainer that said `hello`: the packed buffer, the rollout queue with
    the trainer's credits, the Control with the run's counters, the weight group and the thread
    that receives the weights into the buffer. Returns the spawn context, the children's error
    queue and the Control."""
    # Nothing is served until the trainer's first publish (start or checkpoint weights) arrives.
    bridge.shared = SharedWeights.allocate(
        hello["shapes"], getattr(torch, hello["dtype"]), buffer_device, starts_empty=True
    )
    ctx = mp.get_context("spawn")
    bridge.rollout_queue = ctx.Queue(maxsize=1)  # + the trainer's credits = --queue-size
    errors = ctx.Queue()
    control = processes.make_control(ctx)
    control.groups_dropped.value = hello["groups_dropped"]
    control.steps_skipped.value = hello["steps_skipped"]
    bridge.credits = hello["credits"]
    _, port = split_addr(cfg.generator_addr)
    store = TCPStore(
        "0.0.0.0", port + 1, 2, True, timedelta(seconds=hello["timeout_s"]), wait_for_workers=False
    )
    bridge.link.timeout_s = silence_limit(hello["timeout_s"])  # the run's, from now on
    bridge.control = control  # from here the link mirrors it
    bridge.link.send("welcome", {"store_port": port + 1})
    bridge.group = weight_group(store, 1, torch.device(buffer_device), hello["timeout_s"])
    threading.Thread(target=bridge.receive, name="weights", daemon=True).start()
    return ctx, errors, control
