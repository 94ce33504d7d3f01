"""bench/gpu_trainer.py — the trainer on one GPU against the plain loop a user would write:
tokens/s, peak memory, where a step's time goes, the weight publish against a device-to-device copy.

    python bench/gpu_trainer.py --out DIR    # one GPU, ~3 min (estimated): DIR/gpu_trainer.json
    python bench/gpu_trainer.py --shapes 4b-2k --steps 5 --out DIR
    # the suite's size (tests/test_bench.py): a tiny Qwen3 on the CPU, the same code
    python bench/gpu_trainer.py --device cpu --smoke --out DIR
Estimated on an H200 from the rates issue 37 measured (not yet run there): 0.6b-16k 30 s, 0.6b-2k
20 s, 4b-2k 45 s, 0.6b-longtail 35 s, start-up about 20 s; each --steps more adds a fifth of that.

Role: issue 37's measurement, with torch and transformers alone (no project module it imports loads
vLLM; the JSON records `vllm_imported`), in one process, one FSDP2 rank (NCCL on a GPU, gloo on the
CPU). A shape (`SHAPES`): a random-init model of a published config (`MODELS`), made as
models.build_trainer_model makes one at world size 1 (fp32 masters, `shard_layers_and_root`, bf16
compute, fp32 reduction) but initialised on the device, checkpointed (`models.checkpoint_layers`);
one AdamW; one batch of random tokens (256-token prompts); the modes alternate, `--warmup` rounds
left out, then `--steps` (the order swapped every round):
  - project: `update.update_on_batch`, the project's Config, --micro-batch-tokens the shape's;
  - plain: `model(...)`, full logits, `.float()`, log_softmax, gather, a token-mean policy-gradient
    loss, backward per micro-batch; clip, AdamW. Its micro-batches: as many rows of the budget as
    --micro-batch-tokens holds, in batch order, each padded to its longest row (with every row at
    the budget, the project's micro-batches).
Long-tailed shapes draw completion lengths from a log-normal cut at the budget (`LONG_TAIL`); there
the project packs its rows (`PACKED`: --packing on); the other shapes run the default (auto),
decided by `packing.decide` as train.py's start does.
Data contract: `DIR/gpu_trainer.json`, rewritten after every shape (one cut short by a timeout or an
error leaves those before it): per shape `project_tokens_per_s`, `plain_tokens_per_s` (prompt +
completion tokens, no padding, over the median step), `project_over_plain`, `project_peak_gib`,
`plain_peak_gib` (`torch.cuda.max_memory_allocated` per step; on the CPU the process's peak RSS),
`publish_over_copy` (`sync.publish_model` into a bf16 SharedWeights on the device against one copy
of its bytes there), pad fractions, and each mode's phases in ms per step (`PHASE_OF_MARK`): CUDA
events (perf_counter on the CPU) at the ends of update.py's traced spans (tracing.complete wrapped
here, the project unchanged), at the model's start, the decoder's output and that output's gradient.
May touch: the device and DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import buffer  # noqa: E402
import sync  # noqa: E402
import update  # noqa: E402
from config import Config  # noqa: E402
from generator.shared_weights import SharedWeights, named_shapes_of  # noqa: E402
from infra import devices, tracing  # noqa: E402
from trainer import models, packing  # noqa: E402

# The published configs (config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-4B): what they share, then
# their sizes (SIZE_FIELDS); the smoke's is Qwen3's layout at a size the CPU runs in a second.
QWEN3 = json.loads(
    '{"model_type": "qwen3", "vocab_size": 151936, "head_dim": 128, "hidden_act": "silu", '
    '"max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-06, '
    '"tie_word_embeddings": true, "attention_bias": false, "use_sliding_window": false, '
    '"sliding_window": null, "bos_token_id": 151643, "eos_token_id": 151645}'
)
SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
SIZE_FIELDS += ("num_key_value_heads", "max_window_layers")
MODELS = {
    "qwen3-0.6b": dict(QWEN3, **dict(zip(SIZE_FIELDS, (1024, 3072, 28, 16, 8, 28)))),
    "qwen3-4b": dict(QWEN3, **dict(zip(SIZE_FIELDS, (2560, 9728, 36, 32, 8, 36)))),
    "tiny-qwen3": dict(
        QWEN3, **dict(zip(SIZE_FIELDS, (64, 128, 2, 4, 2, 2))), vocab_size=512, head_dim=16
    ),
}


@dataclass(frozen=True)
class Shape:
    model: str  # a key of MODELS
    rows: int
    seq: int  # tokens per row at the budget: prompt + the longest completion
    micro_batch_tokens: int  # the project's --micro-batch-tokens
    prompt: int = 256
    long_tail: bool = False  # completion lengths drawn (LONG_TAIL), else every row at the budget


SHAPES = {
    "0.6b-16k": Shape("qwen3-0.6b", 4, 16_384, 16_384),
    "0.6b-2k": Shape("qwen3-0.6b", 32, 2_048, 32_768),
    "4b-2k": Shape("qwen3-4b", 16, 2_048, 16_384),
    "0.6b-longtail": Shape("qwen3-0.6b", 32, 8_192, 32_768, long_tail=True),
    "tiny": Shape("tiny-qwen3", 4, 64, 128, prompt=8),
    "tiny-longtail": Shape("tiny-qwen3", 8, 64, 128, prompt=8, long_tail=True),
}
GPU_SHAPES = ("0.6b-16k", "0.6b-2k", "4b-2k", "0.6b-longtail")
SMOKE = {"shapes": "tiny,tiny-longtail", "steps": 2, "warmup": 1, "publish_reps": 2}
# RL completion lengths: log-normal, median a fifth of the budget, sigma 1 (a long right tail: the
# mean is 1.6x the median), cut at the budget (about 5% of rows reach it, as truncated answers do)
LONG_TAIL = {"median_of_budget": 0.2, "sigma": 1.0}
# The packing switch (issue 37, item 4): the project packs the long-tailed rows once Config has it.
# long-tailed lengths: the project packs (refused in one line if the model cannot); else the default
PACKED = {"packing": "on"}
GOALS = {"project_over_plain": 0.97, "long_tail_over_plain": 1.2, "publish_over_copy": 5.0}
LR = 1e-5  # small: random-init weights stay finite through the steps (a skipped update is counted)
SERVING_DTYPE = torch.bfloat16
# A span between two marks belongs to the phase of the mark that ends it. forward: model start ->
# decoder output; head: -> the loss (update.py's span "forward" ends there), and loss -> the hidden
# states' gradient; backward: the rest of it (with the layers' recompute); optimizer: last backward
# -> step end (with clipping); other: between micro-batches.
PHASE_OF_MARK = dict(decoder="forward", forward="head", backward="backward")
PHASE_OF_MARK.update({"head grad": "head", "optimizer step": "optimizer"})
PHASES = ("forward", "head", "backward", "optimizer", "other")


# ---------- The device: synchronisation, peak memory, phase marks ---------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device: torch.device) -> float:
    """This step's peak of allocated memory on the GPU; on the CPU the process's peak RSS so far."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class PhaseClock:
    """Named marks in a step (CUDA events on a GPU, perf_counter on the CPU); `take`, after a
    synchronize, turns them into milliseconds per phase (PHASE_OF_MARK) and clears them."""

    def __init__(self, device: torch.device):
        self.cuda, self.marks = device.type == "cuda", []

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((name, event))
        else:
            self.marks.append((name, time.perf_counter()))

    def take(self) -> dict:
        ms = dict.fromkeys(PHASES, 0.0)
        for (_, start), (name, end) in zip(self.marks, self.marks[1:]):
            span = start.elapsed_time(end) if self.cuda else (end - start) * 1e3
            ms[PHASE_OF_MARK.get(name, "other")] += span
        self.marks = []
        return ms


@contextlib.contextmanager
def phase_marks(model, clock: PhaseClock):
    """Marks at the model's start, the decoder's output and its gradient (hooks), and at the end of
    update.py's traced spans (tracing.complete wrapped while this lasts; the project unchanged)."""
    traced = tracing.complete

    def complete(name, *args, **kwargs):
        clock.mark(name)
        return traced(name, *args, **kwargs)

    def on_decoder(_module, _inputs, output):
        clock.mark("decoder")
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        if hidden.requires_grad:  # its gradient arrives once the head's backward is done
            hidden.register_hook(lambda _grad: clock.mark("head grad"))

    handles = [
        model.register_forward_pre_hook(lambda *_: clock.mark("model"), prepend=True),
        model.get_decoder().register_forward_hook(on_decoder),
    ]
    tracing.complete = complete
    try:
        yield
    finally:
        tracing.complete = traced
        for handle in handles:
            handle.remove()


# ---------- The model, the batch, the two loops ---------------------------------------------------
def build_model(shape: Shape, device: torch.device, seed: int):
    """What models.build_trainer_model makes at world size 1 (fp32 masters, bf16 compute, fp32
    reduction, each layer then the root sharded), random-init on the device, checkpointed."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(**MODELS[shape.model])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=devices.MASTER_DTYPE)
    model.eval()  # as from_pretrained leaves it (dropout off)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=devices.MASTER_DTYPE)
    model = models.shard_layers_and_root(model, model.model.layers, 1, device, mp_policy=policy)
    models.checkpoint_layers(model)
    return model


def completion_lengths(shape: Shape, rng: torch.Generator) -> list[int]:
    budget = shape.seq - shape.prompt
    if not shape.long_tail:
        return [budget] * shape.rows
    median = LONG_TAIL["median_of_budget"] * budget
    normal = torch.randn(shape.rows, generator=rng, dtype=torch.float64)
    drawn = (math.log(median) + LONG_TAIL["sigma"] * normal).exp()
    return [int(min(budget, max(1, round(x)))) for x in drawn.tolist()]


def make_batch(shape: Shape, seed: int) -> buffer.Batch:
    """A rollout batch as buffer.collate builds it: random tokens, behaviour log-probs near a
    uniform model's, standardised random rewards as advantages, every token of version 0."""
    rng = torch.Generator().manual_seed(seed)
    vocab = MODELS[shape.model]["vocab_size"]
    rewards = torch.rand(shape.rows, generator=rng)
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    samples, uniform = [], -math.log(vocab)
    for i, length in enumerate(completion_lengths(shape, rng)):
        ids = torch.randint(3, vocab, (shape.prompt + length,), generator=rng).tolist()
        prompt, completion = ids[: shape.prompt], ids[shape.prompt :]
        reward, advantage = float(rewards[i]), float(advantages[i])
        samples.append(
            buffer.Sample(prompt, completion, [uniform] * length, [0] * length, reward, advantage)
        )
    return buffer.collate(samples, pad_id=0)


def plain_micro_batches(batch: buffer.Batch, shape: Shape) -> list[buffer.Batch]:
    """As many rows of the budget as a micro-batch holds, in batch order, each micro-batch padded to
    its longest row (with every row at the budget: the project's own micro-batches)."""
    per = max(1, shape.micro_batch_tokens // shape.seq)
    return [batch.select(slice(i, i + per)).trimmed() for i in range(0, len(batch), per)]


def plain_step(model, optimizer, micro, cfg: Config, device, clock: PhaseClock) -> dict:
    """The loop a user writes on the same FSDP2 model: full logits, log_softmax, gather, a
    token-mean policy-gradient loss, backward per micro-batch; clip and AdamW."""
    tokens = sum(int(mb.mask.sum()) for mb in micro)
    for mb in micro:
        mb = mb.to(device)
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
        logits = out.logits[:, :-1].float()
        del out
        logp = torch.log_softmax(logits, -1).gather(-1, mb.targets[..., None])[..., 0]
        loss = -(logp * mb.advantages[:, None] * mb.mask).sum() / tokens
        clock.mark("forward")
        loss.backward()
        clock.mark("backward")
        del logits, logp, loss
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    clock.mark("optimizer step")
    return {"skipped": 0}


def project_step(model, optimizer, batch, cfg: Config, device, step: int) -> dict:
    result = update.update_on_batch(model, None, optimizer, batch, cfg, 0, 1, 0, step, device)
    return {"skipped": result.skipped, "pad_frac": result.metrics.get("pad_frac")}


def timed_step(run, device, clock: PhaseClock) -> dict:
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    clock.mark("step")
    start = time.perf_counter()
    out = run()
    clock.mark("end")
    synchronize(device)
    seconds = time.perf_counter() - start
    return dict(out, s=seconds, peak_gib=peak_gib(device), phases_ms=clock.take())


# ---------- Measurements --------------------------------------------------------------------------
def pad_frac(micro: list[buffer.Batch]) -> float:
    positions = sum(mb.attention_mask.numel() for mb in micro)
    return 1 - sum(int(mb.attention_mask.sum()) for mb in micro) / positions


def summary(steps: list[dict], tokens: int) -> dict:
    """A mode's measured steps: median seconds, the rate of it, the highest peak, median phases."""
    median_s = statistics.median(s["s"] for s in steps)
    return {
        "tokens_per_s": tokens / median_s,
        "median_s": median_s,
        "step_s": [s["s"] for s in steps],
        "peak_gib": max(s["peak_gib"] for s in steps),
        "phases_ms": {p: statistics.median(s["phases_ms"][p] for s in steps) for p in PHASES},
        "skipped_updates": sum(s["skipped"] for s in steps),
    }


def train_modes(model, batch, shape: Shape, cfg: Config, args, device) -> dict:
    """Project and plain alternated on the same model and optimizer: {mode: summary}."""
    optimizer = torch.optim.AdamW(  # as train.py builds it, before any forward (FSDP2)
        sync.trainable_parameters(model), lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    clock, micro = PhaseClock(device), plain_micro_batches(batch, shape)
    runs = {
        "project": lambda step: project_step(model, optimizer, batch, cfg, device, step),
        "plain": lambda step: plain_step(model, optimizer, micro, cfg, device, clock),
    }
    measured = {mode: [] for mode in runs}
    with phase_marks(model, clock):
        for step in range(args.warmup + args.steps):
            for mode in list(runs)[:: 1 if step % 2 == 0 else -1]:
                taken = timed_step(lambda: runs[mode](step), device, clock)
                if step >= args.warmup:
                    measured[mode].append(taken)
                print(f"[gpu_trainer]   {mode} step {step}: {taken['s']:.3f} s", flush=True)
    tokens = int(batch.attention_mask.sum())
    out = {mode: summary(steps, tokens) for mode, steps in measured.items()}
    project_pads = [s["pad_frac"] for s in measured["project"] if s.get("pad_frac") is not None]
    out["project"]["pad_frac"] = project_pads[-1] if project_pads else None
    out["plain"]["pad_frac"] = pad_frac(micro)
    return out


def median_ms(run, device, reps: int) -> float:
    """Median wall milliseconds of `run` (synchronised), the first call left out."""
    times = []
    for _ in range(reps + 1):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def measure_publish(model, device, reps: int) -> dict:
    """sync.publish_model into a packed buffer of the serving dtype on the same device (as
    prepare.allocate_shared_weights makes one), against one copy of its bytes there."""
    shared = SharedWeights.allocate(named_shapes_of(model), dtype=SERVING_DTYPE, device=device)
    models.check_layout(model, shared.layout)
    publish_ms = median_ms(lambda: sync.publish_model(model, shared, 1, 0, 1), device, reps)
    target = torch.empty_like(shared.buffer)
    copy_ms = median_ms(lambda: target.copy_(shared.buffer), device, reps)
    return {"bytes": shared.nbytes, "publish_ms": publish_ms, "copy_ms": copy_ms}


def measure_shape(shape: Shape, args, device) -> dict:
    """One shape: the model, the batch, the two modes, the publish; the JSON's fields for it."""
    start = time.perf_counter()
    model = build_model(shape, device, args.seed)
    build_s = time.perf_counter() - start
    batch = make_batch(shape, args.seed)
    changes = dict(micro_batch_tokens=shape.micro_batch_tokens, lr=LR, seed=args.seed)
    changes.update(dtype="bf16", grad_checkpointing=True, **(PACKED if shape.long_tail else {}))
    cfg = dataclasses.replace(Config(), **changes)
    packing.decide(cfg, (model,))  # as train.py does at its start: the probe, the row attention
    modes = train_modes(model, batch, shape, cfg, args, device)
    publish = measure_publish(model, device, args.publish_reps)
    row = {
        "params": sum(p.numel() for p in model.parameters()),
        **dataclasses.asdict(shape),
        "tokens_per_step": int(batch.attention_mask.sum()),
        "completion_tokens_per_step": int(batch.mask.sum()),
        "build_s": build_s,
        "project_packing": cfg.packing,
    }
    for mode, result in modes.items():
        for field in ("tokens_per_s", "peak_gib", "pad_frac"):
            row[f"{mode}_{field}"] = result[field]
    row["project_over_plain"] = row["project_tokens_per_s"] / row["plain_tokens_per_s"]
    row["publish_over_copy"] = publish["publish_ms"] / publish["copy_ms"]
    return dict(row, goals_met=goals_met(row), publish=publish, **modes)


def goals_met(row: dict) -> bool:
    """Issue 37's: the speed ratio (packed against padded on long-tailed lengths) with a lower peak,
    and the publish within GOALS of a copy."""
    goal = GOALS["long_tail_over_plain" if row["long_tail"] else "project_over_plain"]
    fast = row["project_over_plain"] >= goal
    near_copy = row["publish_over_copy"] <= GOALS["publish_over_copy"]
    return fast and near_copy and row["project_peak_gib"] < row["plain_peak_gib"]


# ---------- The run: flags, the process group, the JSON after each shape, the tables --------------
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_out", help="folder for gpu_trainer.json")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument(
        "--shapes", default=",".join(GPU_SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}"
    )
    p.add_argument("--steps", type=int, default=3, help="measured steps of each mode per shape")
    p.add_argument("--warmup", type=int, default=1, help="steps of each mode left out first")
    p.add_argument("--publish-reps", type=int, default=5, help="publishes and copies timed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the suite's size (figures meaningless; flags given beside it win): "
        + " ".join(f"{k}={v!r}" for k, v in SMOKE.items()),
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--smoke" in argv:
        p.set_defaults(**SMOKE)
    args = p.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown or args.steps < 1 or args.warmup < 0 or args.publish_reps < 1:
        p.error(f"unknown shapes {unknown}, or --steps/--publish-reps < 1 or --warmup < 0")
    return args


def machine(device: torch.device) -> dict:
    gpu = device.type == "cuda"
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name(device) if gpu else None,
        "gpu_gib": torch.cuda.get_device_properties(device).total_memory / 2**30 if gpu else None,
        "cores": os.cpu_count(),
    }


@contextlib.contextmanager
def process_group(device: torch.device):
    """One rank: NCCL (and gloo for CPU tensors) on the GPU, gloo on the CPU."""
    init_file = tempfile.mktemp(prefix="asyncgrpo-gpu-trainer-dist-")
    backend = devices.GPU_BACKEND if device.type == "cuda" else devices.CPU_BACKEND
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if os.path.exists(init_file):
            os.unlink(init_file)


def write_report(out: str, report: dict) -> Path:
    path = Path(out) / "gpu_trainer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    report["vllm_imported"] = "vllm" in sys.modules
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return path


def tables(shapes: dict) -> str:
    lines = [
        "| shape | project tok/s | plain tok/s | project / plain | peak GiB project / plain "
        "| pad project / plain | publish / copy ms | publish / copy | goals met |",
        "| --- " * 9 + "|",
    ]
    for name, r in shapes.items():
        pads = [r[f"{mode}_pad_frac"] for mode in ("project", "plain")]
        pads = " / ".join("-" if x is None else f"{x:.2f}" for x in pads)
        lines.append(
            f"| {name} | {r['project_tokens_per_s']:,.0f} | {r['plain_tokens_per_s']:,.0f} | "
            f"{r['project_over_plain']:.2f} | {r['project_peak_gib']:.1f} / "
            f"{r['plain_peak_gib']:.1f} | {pads} | {r['publish']['publish_ms']:.2f} / "
            f"{r['publish']['copy_ms']:.2f} | {r['publish_over_copy']:.1f} | {r['goals_met']} |"
        )
    lines += ["", "| shape | mode | " + " | ".join(PHASES) + " (ms per step) |"]
    lines.append("| --- " * (len(PHASES) + 2) + "|")
    for name, r in shapes.items():
        for mode in ("project", "plain"):
            phases = " | ".join(f"{r[mode]['phases_ms'][p]:.1f}" for p in PHASES)
            lines.append(f"| {name} | {mode} | {phases} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        build = f"torch {torch.__version__}, CUDA build {torch.version.cuda}"
        message = f"no CUDA GPU visible ({build}); --device cpu runs the same code"
        print(f"[gpu_trainer] {message}", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    start = time.perf_counter()
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    report = {"benchmark": "gpu_trainer", "machine": machine(device), "settings": settings}
    report.update(goals=GOALS, long_tail=LONG_TAIL, lr=LR, shapes={}, errors={})
    path = write_report(args.out, report)
    with process_group(device):
        for name in args.shapes:
            print(f"[gpu_trainer] {name}: {SHAPES[name]}", flush=True)
            try:
                report["shapes"][name] = measure_shape(SHAPES[name], args, device)
            except Exception as err:  # (out of memory, say): the next shapes still run
                traceback.print_exc()
                report["errors"][name] = f"{type(err).__name__}: {err}"
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            report["wall_s"] = time.perf_counter() - start
            path = write_report(args.out, report)
    print(tables(report["shapes"]))
    print(f"[gpu_trainer] wrote {path} after {report['wall_s']:.0f} s", flush=True)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
