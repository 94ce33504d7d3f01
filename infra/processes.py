"""infra/processes.py — the run's processes: start them, watch them, end them.

Role: children start from the spawn context; one that raises sends its traceback to the parent and
exits 1, and the parent prints `error: NAME died (...)` with it, kills the rest and returns 1 within
seconds (a SIGKILL the run did not send gets a line naming the memory flag to lower). Ctrl-C or
SIGTERM stop the run after the current step with a checkpoint (130 / 143); a second Ctrl-C stops at
once. A SIGTERM sent to a child is forwarded to the parent (SLURM signals every process of a job
step): any number of them is one stop. While a trainer saves (`saving`), the parent waits for it up
to --save-timeout-s before it kills. The generator has its own process group, so killing it also
kills vLLM's EngineCore: nothing is left behind; a child whose parent dies (SIGKILL, a CI timeout)
ends at once, with its group. A child that succeeds, and the parent, end without the interpreter's
teardown (`exit_now`). Data contract: `Control`, the flags and counters every child shares;
`run_children(ctx, children, errors, control)`, children by name -> (function, args,
own_process_group) ("trainer*" ranks end the run; a generator node, remote.py, runs the generator
alone); (name, traceback) pairs on `errors` (or (name, "error: ..."): a child's deliberate stop,
printed as that one line). May touch: the processes it starts, the parent's signal
handlers while the run lasts.
"""

import atexit
import contextlib
import multiprocessing.connection
import multiprocessing.util
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass


@dataclass
class Control:
    """Shared flags and counters (from the spawn context, so children can use them)."""

    stop: object  # Event: everyone winds down
    # Event: the generator's engine is up and serving (start weights loaded, step 0 evaluated)
    ready: object
    # Event: vLLM has started and measured its GPU (a GPU it shares is free to use now)
    engine_started: object
    # Value: groups the trainer rejected entirely (the generator replaces them)
    groups_dropped: object
    # Value: steps that made no new version (every update NaN/inf): version = step - this
    steps_skipped: object
    loaded_version: object  # Value: the version the generator serves now
    interrupted: object  # Event: a signal asked the run to stop (the trainer checkpoints)
    # Array [step, version]: the newest evaluation the trainer asked for (step -1: none)
    eval_request: object
    eval_results: object  # Queue: evaluation.EvalResult from the generator to the trainer's rank 0
    # Value: trainer ranks inside a save now (the parent's grace lasts while it is > 0)
    saving: object


def make_control(ctx) -> Control:
    return Control(
        stop=ctx.Event(),
        ready=ctx.Event(),
        engine_started=ctx.Event(),
        groups_dropped=ctx.Value("q", 0),
        steps_skipped=ctx.Value("q", 0),
        loaded_version=ctx.Value("q", 0),
        interrupted=ctx.Event(),
        eval_request=ctx.Array("q", [-1, 0]),
        eval_results=ctx.Queue(),
        saving=ctx.Value("q", 0),
    )


@contextlib.contextmanager
def saving(control):
    """Mark a save in progress for the parent's grace (see run_children)."""
    with control.saving.get_lock():
        control.saving.value += 1
    try:
        yield
    finally:
        with control.saving.get_lock():
            control.saving.value -= 1


def forward_to(parent_pid: int):
    """A signal handler that passes the signal on to the parent, which decides what it means (and to
    no one once the parent is gone: the pid may belong to another process by then)."""

    def forward(signum, frame):
        if os.getppid() == parent_pid:
            os.kill(parent_pid, signum)

    return forward


def child_entry(name, fn, args, errors, own_process_group):
    """Run `fn(*args)` in a child; on any failure send the traceback to the parent and exit 1."""
    if own_process_group:
        # the parent can kill this child and every process it starts (vLLM's EngineCore)
        os.setpgrp()
    else:
        # the parent decides what Ctrl-C means (it gets it too)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, forward_to(os.getppid()))
    end_with_parent(own_process_group)
    try:
        fn(*args)
    except BaseException as failure:
        # a child that stops the run on purpose (SystemExit("error: ...")) sends its one line, not a
        # traceback (train.check_first_agreement)
        one_line = isinstance(failure, SystemExit) and is_one_line_error(failure.code)
        errors.put((name, failure.code if one_line else traceback.format_exc()))
        errors.close()
        errors.join_thread()  # the traceback must reach the parent before this process ends
        sys.stderr.flush()
        os._exit(1)
    exit_now(0)


def exit_now(code: int) -> None:
    """End this process once its work is done: the exit handlers run (atexit's, then
    multiprocessing's, which hands on what the process put on the run's queues), but not the
    interpreter's teardown of torch and vLLM (their C++ threads and allocations: 3-20 s at the end
    of every run, none of it ours)."""
    atexit._run_exitfuncs()
    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def end_with_parent(own_process_group: bool) -> None:
    """If the parent dies without ending the run (SIGKILL, the OOM killer, a CI timeout), this child
    ends too, with every process it started (a generator's group holds vLLM's EngineCore): no orphan
    keeps a core busy."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        multiprocessing.connection.wait([parent.sentinel])  # readable once the parent is gone
        if own_process_group:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def wait_for(event, stop, timeout_s, what) -> bool:
    """True once `event` is set; False if `stop` is set first; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not event.wait(0.2):
        if stop.is_set():
            return False
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
    return True


def kill_tree(proc, own_group: bool):
    if proc.pid is None:
        return
    try:
        if own_group:
            os.killpg(proc.pid, signal.SIGKILL)
        elif proc.is_alive():
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass


def run_children(
    ctx,
    children: dict,
    errors,
    control: Control,
    failed=None,
    on_failure=None,
    save_grace_s: float = 0.0,
) -> int:
    """Start every child, supervise them until the trainers finish or something fails, then make
    sure none is left. Returns 0, 1 (a child failed), or 128 + the signal that stopped the run.
    Without trainer children (a generator node, remote.py) the run ends when the generator does;
    `failed` (an Event another thread of this process sets, having printed why) ends it with 1;
    `on_failure(report)` also gets the failure report printed for a child. While the run ends,
    trainers get GRACE_S to exit, longer while one saves (`control.saving`), up to `save_grace_s`
    (--save-timeout-s)."""
    procs = {
        name: (
            ctx.Process(target=child_entry, name=name, args=(name, fn, args, errors, own_group)),
            own_group,
        )
        for name, (fn, args, own_group) in children.items()
    }
    interrupted = []

    def on_signal(signum, frame):
        # a second Ctrl-C stops now; more SIGTERMs are the same stop (SLURM, forwarded ones)
        if interrupted:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        interrupted.append(signum)
        print(
            f"\n{signal.Signals(signum).name}: stopping after the current step and writing a "
            f"checkpoint (press Ctrl-C again to stop at once)",
            file=sys.stderr,
            flush=True,
        )
        control.interrupted.set()
        control.stop.set()

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        for proc, _ in procs.values():
            proc.start()
        code = supervise(procs, errors, control, failed, on_failure)
    except KeyboardInterrupt:
        code = 130
    finally:
        control.stop.set()
        # Trainers first: they hold what must be saved (a checkpoint on a stop). After a failure the
        # generator has nothing to save and its engine may be dead: it gets no grace then.
        generator, own_group = procs["generator"]
        if code != 0:
            kill_tree(generator, own_group)
        now = time.monotonic()
        deadline, save_deadline = now + GRACE_S, now + max(GRACE_S, save_grace_s)
        for name, (proc, own_group) in reversed(list(procs.items())):
            while proc.exitcode is None:
                limit = save_deadline if control.saving.value > 0 else deadline
                if time.monotonic() >= limit:
                    break
                proc.join(timeout=min(0.5, max(0.1, limit - time.monotonic())))
            kill_tree(proc, own_group)  # also reaps vLLM's EngineCore left in the generator's group
        for s, h in old_handlers.items():
            signal.signal(s, h)
    if interrupted and code == 0:
        code = 128 + interrupted[0]  # 130 for SIGINT, 143 for SIGTERM, as a shell reports them
    return code


# what a child gets to exit once the run ends (a trainer inside a save: up to --save-timeout-s)
GRACE_S = 20


def supervise(procs, errors, control, failed=None, on_failure=None) -> int:
    """Wait until the trainers finish (0) or any child fails (1, with its traceback printed)."""
    trainers = [p for name, (p, _) in procs.items() if name.startswith("trainer")]
    while True:
        sentinels = [p.sentinel for p, _ in procs.values() if p.exitcode is None]
        multiprocessing.connection.wait(sentinels, timeout=0.2 if failed is not None else 1.0)
        for name, (proc, _) in procs.items():
            if name == "generator" and trainers and control.interrupted.is_set():
                # A stop on a signal (SLURM sends it to vLLM too): the generator's end is expected,
                # and the trainers' checkpoint is what matters.
                continue
            if proc.exitcode is not None and proc.exitcode != 0:
                report = failure_report(name, proc.exitcode, errors)
                print(report, file=sys.stderr, flush=True)
                if on_failure is not None:
                    on_failure(report)
                return 1
        if failed is not None and failed.is_set():
            return 1
        if not trainers:  # a generator node: its generator stopping when asked is the end
            if procs["generator"][0].exitcode == 0 and control.stop.is_set():
                return 0
        elif all(p.exitcode == 0 for p in trainers):
            generator = procs["generator"][0]
            generator.join(timeout=60)  # it stops on control.stop and shuts its engine down
            if generator.exitcode not in (0, None) and not control.interrupted.is_set():
                print(
                    failure_report("generator", generator.exitcode, errors),
                    file=sys.stderr,
                    flush=True,
                )
            return 0
        if procs["generator"][0].exitcode == 0 and not control.stop.is_set():
            print(
                "error: the generator exited before the trainer finished",
                file=sys.stderr,
                flush=True,
            )
            return 1


def failure_report(name, exitcode, errors) -> str:
    reports = []
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            reports.append(errors.get(timeout=0.2))
        except Exception:
            if reports:
                break
    # children that stopped the run on purpose, each with its reason in one line (every rank of a
    # check that failed on all of them: the same line)
    if reports and all(is_one_line_error(tb) for _, tb in reports):
        return "\n".join(dict.fromkeys(tb for _, tb in reports))
    how = f"signal {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exit code {exitcode}"
    text = [f"error: {name} died ({how}); stopping the run"]
    if exitcode == -signal.SIGKILL:
        text.append(killed_by_kernel_hint(name))
    for who, tb in reports:
        text.append(tb if is_one_line_error(tb) else f"--- traceback from {who} ---\n{tb}")
    return "\n".join(text)


def is_one_line_error(text) -> bool:
    """A reason a child gave for stopping the run, as the user reads it: "error: ...", one line."""
    return isinstance(text, str) and text.startswith("error: ") and "\n" not in text.strip()


# What lowers the memory of each kind of child, for the hint below.
MEMORY_FLAGS = {
    "trainer": "--micro-batch-tokens (fewer tokens per forward/backward; or fewer "
    "--prompts-per-step x --group-size, or a shorter --max-new-tokens)",
    "generator": "--kv-cache-mb on CPU, --gpu-memory-utilization on GPUs, or --max-model-len",
}


def killed_by_kernel_hint(name: str) -> str:
    """The line after a child's SIGKILL. The run itself sends SIGKILL only while it ends (kill_tree,
    after supervise has reported), so this one came from outside: almost always the kernel's
    out-of-memory killer."""
    flags = MEMORY_FLAGS["trainer" if name.startswith("trainer") else "generator"]
    return (
        f"error: the run did not send that SIGKILL: most likely the kernel killed {name} for lack "
        f"of memory (the run needed more than the machine has). Lower its memory with {flags}"
    )
