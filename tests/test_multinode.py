"""Beyond one node (remote.py), with "two nodes" on this machine over 127.0.0.1.

Without vLLM: the bucketed weight transfer over a 2-member gloo group (two processes), the credit
bound of the rollout link, and a link ending when the other side errs or goes silent.
With vLLM (three engine starts): `train.py --role generator` and `torchrun --nproc-per-node 2
train.py --role trainer` train a few steps (versions, lag and queue bounds asserted as on one node);
SIGKILL of the generator node ends the trainer non-zero with a checkpoint; SIGKILL of the trainer
ends the generator node non-zero. Nothing is left behind in any case. Never run on real separate
machines or GPUs.
"""

import os
import queue
import socket
import threading
import time
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp
from runs import SMALL, is_engine_core

from run import link, remote, remote_generator


def free_port(pair: bool = False) -> int:
    """A free port (with `pair`, PORT + 1 free too: the generator node's weight store)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not pair:
            return port
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


# --------------------------------------------------------------------------------------------------
# Without vLLM
# --------------------------------------------------------------------------------------------------
def _weights_side(rank, port, data, results):
    from datetime import timedelta

    from torch.distributed import TCPStore

    from generator.shared_weights import SharedWeights

    store = TCPStore("127.0.0.1", port, 2, rank == 1, timedelta(seconds=30))
    group = link.weight_group(store, rank, torch.device("cpu"), 30)
    if rank == 0:
        link.send_weights(group, data, bucket_bytes=1000)
    else:
        shared = SharedWeights.allocate(
            [("a", (data.numel() - 10,)), ("b", (2, 5))], dtype=data.dtype
        )
        link.receive_weights(group, shared, 7, bucket_bytes=1000)
        results.put(
            (
                shared.buffer.view(torch.int16).numpy().tobytes(),
                shared.version(),
                int(shared.header[0]),
            )
        )
        results.close()
        results.join_thread()
    # skip the interpreter's exit, where gloo's threads can abort a process (as in test_fsdp)
    os._exit(0)


def test_weights_cross_in_buckets_over_gloo_into_the_packed_buffer():
    # 6002 bytes: 7 buckets, the last short
    data = torch.randn(3001, dtype=torch.float32).to(torch.bfloat16)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_weights_side, args=(rank, port, data, results)) for rank in (1, 0)]
    for p in procs:
        p.start()
    try:
        buffer, version, seq = results.get(timeout=60)
    finally:
        for p in procs:
            p.join(timeout=30)
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    assert buffer == data.view(torch.int16).numpy().tobytes()  # bf16, bit for bit
    assert version == 7 and seq == 2  # published once, consistent (even)


def _link_pair(queue_size, timeout_s=30.0):
    """A trainer's link and a generator node's bridge connected over loopback, no engine, no
    weights."""
    addr = f"127.0.0.1:{free_port()}"
    cfg = SimpleNamespace(generator_addr=addr, timeout_s=timeout_s, queue_size=queue_size)
    bridge = remote_generator.GeneratorBridge(cfg)
    bridge.control, bridge.rollout_queue = remote.thread_control(), queue.Queue(maxsize=1)
    bridge.credits = queue_size - 1
    trainer = remote.TrainerLink(cfg)
    trainer.connected = True  # (the handshake is the end-to-end tests')
    return trainer, bridge


def test_credits_keep_at_most_queue_size_groups_between_the_generator_and_the_trainer():
    queue_size, total = 4, 40
    trainer, bridge = _link_pair(queue_size)
    put = []

    def produce():  # the generator: a blocking put into the node's own queue, as fast as it can
        for i in range(total):
            bridge.rollout_queue.put(i)
            put.append(i)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    taken, most_waiting = [], 0
    try:
        for _ in range(total):
            time.sleep(0.02)  # a slow trainer: the generator runs into the bound
            most_waiting = max(most_waiting, len(put) - len(taken))  # finished, not yet taken
            taken.append(trainer.get(timeout=10))
    finally:
        trainer.close()
        bridge.link.close()
    assert taken == list(range(total))  # every group, in order
    assert most_waiting <= queue_size
    # the credits, all used, never more
    assert trainer.metrics()["remote_groups_held_max"] == queue_size - 1
    assert not trainer.link.failed.is_set() and not bridge.link.failed.is_set()


def test_an_error_or_silence_from_the_other_side_ends_the_link(capsys):
    trainer, bridge = _link_pair(4, timeout_s=4.0)  # silence limit: max(3 heartbeats, half of 4 s)
    try:
        assert bridge.link.heard.wait(10)
        bridge.link.close("error", "failed: boom")
        assert trainer.link.failed.wait(10)
        assert trainer.control.stop.is_set()  # the trainer's ranks stop (and checkpoint)
    finally:
        trainer.close()
    assert f"error: the generator at {trainer.addr} failed: boom" in capsys.readouterr().err

    trainer, bridge = _link_pair(4, timeout_s=4.0)
    try:
        assert bridge.link.heard.wait(10)
        t0 = time.monotonic()
        trainer.link.closed.set()  # the trainer goes silent (as if its machine died)
        assert bridge.link.failed.wait(15)
        assert 2.5 < time.monotonic() - t0 < 10
        assert bridge.control.stop.is_set()
    finally:
        bridge.link.close()
    assert f"error: the trainer at {bridge.addr} sent nothing for" in capsys.readouterr().err


def test_a_message_lost_across_a_reconnect_ends_the_link_instead_of_being_skipped():
    """ZMQ drops what was queued for a broken connection: a peer whose message 2 never arrived (a
    credit, a group, a weights header) must end the link at message 3, and nothing from message 3 on
    is delivered."""
    import zmq

    addr = f"127.0.0.1:{free_port()}"
    received, failures = [], []
    receiver = link.Link(
        addr,
        True,
        30.0,
        lambda kind, *args: received.append((kind, *args)),
        on_fail=failures.append,
    )
    context = zmq.Context()
    peer = context.socket(zmq.DEALER)
    peer.linger = 0
    try:
        peer.connect(f"tcp://{addr}")
        peer.send_pyobj((1, "credit", 1))
        peer.send_pyobj((3, "credit", 1))  # message 2 was lost
        peer.send_pyobj((4, "credit", 1))
        assert receiver.failed.wait(10)
        time.sleep(0.2)
    finally:
        peer.close()
        context.term()
        receiver.close()
    assert received == [("credit", 1)]
    assert len(failures) == 1 and "lost 1 message(s) across a reconnect" in failures[0]


# --------------------------------------------------------------------------------------------------
# Two "nodes" on 127.0.0.1, with vLLM
# --------------------------------------------------------------------------------------------------
# --timeout-s of both sides, as on one node: vLLM is slow to start on 2 busy cores. A killed side is
# noticed sooner, from its dropped connection (link.RECONNECT_S).
TIMEOUT_S = 300
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")


def wait_watching(run, other, timeout: float) -> int:
    """`run.wait`, recording `other`'s processes meanwhile too (both "nodes" are watched for
    leftovers)."""
    deadline = time.monotonic() + timeout
    while run.poll() is None and time.monotonic() < deadline:
        other.poll()
        time.sleep(0.25)
    return run.wait(max(1.0, deadline - time.monotonic()))


def start_nodes(start_run, *trainer_args):
    addr = f"127.0.0.1:{free_port(pair=True)}"
    generator = start_run(
        "--role",
        "generator",
        "--generator-addr",
        addr,
        "--gen-threads",
        "1",
        "--timeout-s",
        str(TIMEOUT_S),
        name="generator_node",
    )
    trainer = start_run(
        "--role",
        "trainer",
        "--generator-addr",
        addr,
        "--train-threads",
        "1",
        "--timeout-s",
        str(TIMEOUT_S),
        "--log-every",
        "1",
        *SMALL,
        *trainer_args,
        name="trainer",
        launcher=TORCHRUN,
    )
    return addr, generator, trainer


def test_two_nodes_train_with_exact_versions_and_the_lag_and_queue_bounds(start_run):
    """In --update-mode drain (running requests finish on the old weights): test_pipeline's
    single-node lag test runs inflight."""
    steps, queue_size = 6, 4
    addr, generator, trainer = start_nodes(
        start_run,
        "--steps",
        str(steps),
        "--max-lag",
        "1",
        "--queue-size",
        str(queue_size),
        "--eval-every",
        "3",
        "--eval-samples",
        "2",
        "--update-mode",
        "drain",
    )
    assert wait_watching(trainer, generator, 400) == 0, trainer.tail()
    assert generator.wait(60) == 0, generator.tail()
    assert trainer.leftovers(grace_s=10) == [] and generator.leftovers(grace_s=10) == []
    assert any(map(is_engine_core, generator.names.values())), generator.names
    # torchrun's two ranks
    assert len([p for p in trainer.names.values() if p.startswith("python")]) >= 2

    rows, summary = trainer.rows(), trainer.summary()
    assert [r["step"] for r in rows] == list(range(steps))
    assert [r["version"] for r in rows] == list(range(1, steps + 1))
    assert (
        summary["steps"] == steps
        and summary["tokens_trained"] == sum(r["tokens"] for r in rows) > 0
    )
    assert summary["config"]["update_mode"] == "drain" and summary["max_token_lag"] <= 1
    lags = [r["lag_max"] for r in rows]
    assert all(0 <= lag <= 1 for lag in lags) and 1 in lags, lags  # asynchronous, and bounded
    # every token carries its version: the generator served exactly what the trainer sent (the start
    # weights too), so fully on-policy rows agree to fp32 precision
    diffs = [r["logprob_diff_on_policy"] for r in rows if r["logprob_diff_on_policy"] is not None]
    assert diffs and max(diffs) < 1e-4, diffs
    # the queue bound: the trainer never held more than its
    # credits (queue_size - 1; the node's queue holds 1)
    assert all(r["remote_groups_held_max"] <= queue_size - 1 for r in rows)
    assert all(r["sync_send_ms"] is not None and r["sync_send_ms"] > 0 for r in rows)
    assert [r["eval/step"] for r in rows if "eval/step" in r] == [0, 3, 6]  # evaluations cross too
    assert (trainer.out / "model" / "config.json").exists()


def test_generator_node_killed_ends_the_trainer_with_a_checkpoint(start_run):
    addr, generator, trainer = start_nodes(start_run, "--steps", "1000", "--max-lag", "1")
    trainer.wait_rows(2, timeout=400)
    generator.record()
    killed_at = time.monotonic()
    generator.kill_all()  # the machine is gone: the node's process and everything it started
    code = trainer.wait(120)
    assert code != 0 and time.monotonic() - killed_at < 60
    err = trainer.stderr()
    # disconnected, or gone mid-send
    assert f"error: the generator at {addr} " in err, trainer.tail()
    assert list((trainer.out / "checkpoints").glob("step_*/dcp/.metadata")), trainer.tail()
    assert trainer.leftovers(grace_s=10) == [] and generator.leftovers(grace_s=5) == []


def test_trainer_killed_ends_the_generator_node(start_run):
    addr, generator, trainer = start_nodes(start_run, "--steps", "1000", "--max-lag", "1")
    trainer.wait_rows(2, timeout=400)
    generator.record()
    killed_at = time.monotonic()
    trainer.kill_all()  # torchrun and both ranks
    code = generator.wait(120)
    assert code != 0 and time.monotonic() - killed_at < 60
    assert f"error: the trainer at {addr}" in generator.stderr(), generator.tail()
    assert generator.leftovers(grace_s=10) == [] and trainer.leftovers(grace_s=5) == []
