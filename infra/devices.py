"""infra/devices.py — which devices each process uses (`--gen-devices`, `--train-devices`), in what
precision.

Role: turns the two flags into a `DeviceLayout`: the CPU path (the default, and the fallback without
GPUs), or vLLM on the generator's GPU(s), one FSDP2 rank per trainer GPU (NCCL; gloo for small CPU
tensors) and the packed weight buffer on the first trainer GPU, shared with the generator through
CUDA IPC. Data contract
    - A device list is "" / "cpu", or distinct GPU indices as the launcher sees them ("0", "1,2,3").
    - The generator gets CUDA_VISIBLE_DEVICES = its GPUs, then the buffer's GPU if not among them.
    - A GPU both sides use is shared: vLLM gets SHARED_GEN_FRACTION of it, the trainer rank a cap on
      the rest of SHARED_BUDGET, and touches no GPU until vLLM has started (vLLM measures free
      memory at start).
    - vLLM starts only if its share of a GPU is free when it starts. The packed weight buffer is
      there first where it lies on vLLM's GPU (a shared GPU; the generator node's), so the shares
      leave it room (`buffer_fraction`: its size over the GPU's memory) and RESERVED_FRACTION for
      CUDA contexts.
    - `--dtype auto` resolves here: bf16 on GPUs, CPU_DEFAULT_DTYPE on the CPU.
    - A bad value raises `DeviceError`, whose message is one line.
Also what vLLM cannot serve on them (`engine_problems`, found from config.json before anything
starts), and how many sequences its scheduler runs at once (`engine_concurrency`). May touch:
nothing (reads the CUDA device count and the environment), except where a process enters its
placement: the generator's CUDA_VISIBLE_DEVICES, a trainer rank's current GPU and its memory cap.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
from transformers import AutoConfig

from infra.kv_cache import kv_bytes_per_token

# vLLM's share of a GPU it shares with a trainer rank (--gpu-memory-utilization 0)
SHARED_GEN_FRACTION = 0.3
# vLLM's share + the trainer rank's cap on a shared GPU; 0.15 left for contexts and the buffer
SHARED_BUDGET = 0.85
# the least a trainer rank gets on a shared GPU, whatever --gpu-memory-utilization
MIN_SHARED_TRAIN_FRACTION = 0.2
# the trainer rank's cap there, by default (0.55)
SHARED_TRAIN_FRACTION = round(SHARED_BUDGET - SHARED_GEN_FRACTION, 4)
DEDICATED_GEN_FRACTION = 0.9  # vLLM's default, on a GPU of its own
# of a GPU holding the weight buffer and vLLM: CUDA contexts, allocator slack
RESERVED_FRACTION = 0.05
MIN_GEN_FRACTION = 0.1  # the least share vLLM is given where the weight buffer shares its GPU
# --dtype auto: bf16 where the hardware runs it fast (GPUs); on CPU what measured faster here
# (bench/README.md: bench/training.py --what dtype on the 2-core AMD EPYC with avx512_bf16)
GPU_DEFAULT_DTYPE = "bf16"
CPU_DEFAULT_DTYPE = "fp32"
DTYPES = ("bf16", "fp32")
# master weights, gradients, optimizer state and saved models, whatever --dtype
MASTER_DTYPE = torch.float32
GPU_BACKEND = "cpu:gloo,cuda:nccl"
CPU_BACKEND = "gloo"


class DeviceError(ValueError):
    """A bad --gen-devices / --train-devices value; the message is one line."""


@dataclass(frozen=True)
class DeviceLayout:
    kind: str  # "cpu" | "cuda"
    world_size: int  # trainer ranks
    gen_devices: tuple[int, ...] = ()  # GPU indices as the launcher sees them; () on the CPU
    train_devices: tuple[int, ...] = ()
    shared_gpus: tuple[int, ...] = ()  # GPUs both sides use
    backend: str = CPU_BACKEND  # torch.distributed backend of the trainer ranks
    # where the packed weight buffer is allocated (by the launching process)
    buffer_device: str = "cpu"
    gen_visible_devices: str = ""  # CUDA_VISIBLE_DEVICES for the generator process ("" on the CPU)
    gpu_memory_utilization: float = 0.0  # vLLM's; 0 on the CPU
    train_memory_fraction: float | None = None  # per-process cap of a trainer rank on a shared GPU
    notice: str = ""  # one line to print (GPUs asked for, none available)

    @property
    def on_gpu(self) -> bool:
        return self.kind == "cuda"

    @property
    def tensor_parallel_size(self) -> int:
        return max(1, len(self.gen_devices))

    def train_device(self, rank: int) -> str:
        """The device trainer rank `rank` computes on ("cpu" or "cuda:N")."""
        return f"cuda:{self.train_devices[rank]}" if self.on_gpu else "cpu"

    def shares_gpu(self, rank: int) -> bool:
        return self.on_gpu and self.train_devices[rank] in self.shared_gpus

    def generator_settings(self) -> dict:
        """Keyword arguments for config.GeneratorSettings: none on the CPU (its defaults are the
        CPU path)."""
        if not self.on_gpu:
            return {}
        return {
            "device": "cuda",
            "cuda_visible_devices": self.gen_visible_devices,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "tensor_parallel_size": self.tensor_parallel_size,
        }


def parse_devices(text: str, flag: str = "--devices") -> tuple[int, ...]:
    """ "" or "cpu" -> (); "0" -> (0,); "1,2,3" -> (1, 2, 3). Raises DeviceError (one line)
    otherwise."""
    text = (text or "").strip()
    if text.lower() in ("", "cpu"):
        return ()
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():  # also rejects "-1", "cuda:0", "" (as in "1,,2")
            raise DeviceError(
                f"{flag} {text!r}: give comma-separated GPU indices like 0 or 1,2,3 (or cpu)"
            )
        out.append(int(part))
    if len(set(out)) != len(out):
        raise DeviceError(f"{flag} {text!r}: a GPU appears twice")
    return tuple(out)


def cuda_device_count() -> int:
    """GPUs this process can use (0 when torch has no CUDA or no driver)."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver counts as no GPU: the CPU path still works
        return 0


def visible_tokens(count: int, env: str | None) -> list[str]:
    """How each GPU index of this process is named in CUDA_VISIBLE_DEVICES (so a child sees the same
    GPU)."""
    if env is None or not env.strip():
        return [str(i) for i in range(count)]
    tokens = [t.strip() for t in env.split(",") if t.strip()]
    return tokens[:count] if len(tokens) >= count else [str(i) for i in range(count)]


def plan(
    gen_devices: str,
    train_devices: str,
    train_ranks: int = 1,
    cuda_count: int | None = None,
    visible_env: str | None = None,
    gpu_memory_utilization: float = 0.0,
    buffer_fraction: float = 0.0,
) -> DeviceLayout:
    """Decide the layout. `cuda_count` None: ask torch (only when a GPU is asked for).
    `visible_env`: the launcher's CUDA_VISIBLE_DEVICES (None: read it from the environment).
    `gpu_memory_utilization`: vLLM's share of each of its GPUs (0: DEDICATED_GEN_FRACTION, or on a
    GPU shared with a trainer rank SHARED_GEN_FRACTION); on a shared GPU the trainer rank is capped
    at the rest of SHARED_BUDGET, which leaves the weight buffer (`buffer_fraction` of that GPU)
    room too."""
    if not 0 <= gpu_memory_utilization < 1:
        raise DeviceError(
            f"--gpu-memory-utilization must be in (0, 1), or 0 for the default "
            f"(got {gpu_memory_utilization})"
        )
    gen = parse_devices(gen_devices, "--gen-devices")
    train = parse_devices(train_devices, "--train-devices")
    if not gen and not train:
        return DeviceLayout(kind="cpu", world_size=train_ranks)
    if not gen or not train:
        raise DeviceError(
            "--gen-devices and --train-devices go together: give both GPU lists (e.g. "
            "--gen-devices 0 --train-devices 1), or neither for the CPU path"
        )
    if cuda_count is None:
        cuda_count = cuda_device_count()
    if cuda_count == 0:
        return DeviceLayout(
            kind="cpu",
            world_size=train_ranks,
            notice=f"notice: --gen-devices {gen_devices} --train-devices {train_devices} ignored: "
            "no CUDA device here (torch.cuda.is_available() is False); running the CPU path",
        )
    for flag, devs in (("--gen-devices", gen), ("--train-devices", train)):
        bad = [d for d in devs if d >= cuda_count]
        if bad:
            raise DeviceError(
                f"{flag} {','.join(map(str, devs))}: GPU {bad[0]} does not exist "
                f"(this process sees {cuda_count} GPU(s): 0..{cuda_count - 1})"
            )
    if train_ranks not in (1, len(train)):
        raise DeviceError(
            f"--train-ranks {train_ranks} does not match --train-devices {train_devices} "
            f"({len(train)} GPU(s)): on GPUs there is one trainer rank per GPU"
        )
    names = visible_tokens(
        cuda_count, os.environ.get("CUDA_VISIBLE_DEVICES") if visible_env is None else visible_env
    )
    return gpu_layout(gen, train, names, gpu_memory_utilization, buffer_fraction)


def gpu_layout(
    gen: tuple[int, ...],
    train: tuple[int, ...],
    names: list[str],
    gpu_memory_utilization: float,
    buffer_fraction: float,
) -> DeviceLayout:
    """The layout of GPU lists `plan` has checked: one trainer rank per GPU of `train`, the weight
    buffer on the first, vLLM's share of its GPUs, and the trainer's cap on a GPU both use. `names`:
    each GPU index as CUDA_VISIBLE_DEVICES names it."""
    shared = tuple(d for d in train if d in gen)
    buffer_gpu = train[0]
    gen_visible = list(gen) + ([buffer_gpu] if buffer_gpu not in gen else [])
    gen_fraction = gpu_memory_utilization or (
        SHARED_GEN_FRACTION if shared else DEDICATED_GEN_FRACTION
    )
    return DeviceLayout(
        kind="cuda",
        world_size=len(train),
        gen_devices=gen,
        train_devices=train,
        shared_gpus=shared,
        backend=GPU_BACKEND,
        buffer_device=f"cuda:{buffer_gpu}",
        gen_visible_devices=",".join(names[d] for d in gen_visible),
        gpu_memory_utilization=gen_fraction,
        train_memory_fraction=shared_train_fraction(shared, gen_fraction, buffer_fraction),
    )


def shared_train_fraction(
    shared: tuple[int, ...], gen_fraction: float, buffer_fraction: float
) -> float | None:
    """A trainer rank's cap on a GPU it shares with vLLM (None: no GPU is shared): the rest of the
    budget once vLLM has its share, that budget lowered where the weight buffer (on the first
    trainer GPU, `buffer_fraction` of it) leaves less. Refused below MIN_SHARED_TRAIN_FRACTION."""
    if not shared:
        return None
    budget = round(min(SHARED_BUDGET, 1 - RESERVED_FRACTION - buffer_fraction), 4)
    train_fraction = round(budget - gen_fraction, 4)
    if train_fraction < MIN_SHARED_TRAIN_FRACTION:
        beside_buffer = (
            f" with the weight buffer ({buffer_fraction:.0%} of it)" if buffer_fraction else ""
        )
        raise DeviceError(
            f"--gpu-memory-utilization {gen_fraction} on GPU {shared[0]}, which a trainer rank "
            f"shares{beside_buffer}, leaves the trainer {train_fraction:.0%} of it: give at most "
            f"{budget - MIN_SHARED_TRAIN_FRACTION:.2f} there (0: {SHARED_GEN_FRACTION}), or give "
            "the trainer a GPU of its own"
        )
    return train_fraction


def generator_share_beside_buffer(requested: float, buffer_fraction: float) -> float:
    """vLLM's share of a GPU of its own that also holds the packed weight buffer (the generator
    node's GPU): `requested` (0: DEDICATED_GEN_FRACTION, lowered to fit) at most 1 - buffer -
    RESERVED_FRACTION, since vLLM refuses to start unless its share is free. A requested share that
    does not fit is refused."""
    room = round(1 - RESERVED_FRACTION - buffer_fraction, 4)
    if room < MIN_GEN_FRACTION:
        raise DeviceError(
            f"the weight buffer takes {buffer_fraction:.0%} of the generator's GPU: too little is "
            f"left for vLLM (use --dtype bf16, or a GPU with more memory)"
        )
    if requested > room:
        raise DeviceError(
            f"--gpu-memory-utilization {requested} does not fit beside the weight buffer "
            f"({buffer_fraction:.0%} of the GPU): give at most {room} (0: the most that fits)"
        )
    return requested or min(DEDICATED_GEN_FRACTION, room)


def layout_for(cfg, buffer_fraction: float = 0.0) -> DeviceLayout:
    """The layout of a config.Config (reads cfg.gen_devices, cfg.train_devices, cfg.train_ranks,
    cfg.gpu_memory_utilization); `buffer_fraction`: the packed weight buffer over its GPU's
    memory."""
    return plan(
        getattr(cfg, "gen_devices", ""),
        getattr(cfg, "train_devices", ""),
        cfg.train_ranks,
        gpu_memory_utilization=getattr(cfg, "gpu_memory_utilization", 0.0),
        buffer_fraction=buffer_fraction,
    )


def gpu_fraction(nbytes: int, device: str) -> float:
    """`nbytes` over the total memory of GPU `device` ("cuda:N")."""
    return nbytes / torch.cuda.get_device_properties(torch.device(device)).total_memory


def resolve_dtype(choice: str, layout: DeviceLayout) -> str:
    """--dtype: "bf16" or "fp32" as given; "auto" is GPU_DEFAULT_DTYPE on GPUs, CPU_DEFAULT_DTYPE on
    the CPU."""
    if choice == "auto":
        return GPU_DEFAULT_DTYPE if layout.on_gpu else CPU_DEFAULT_DTYPE
    if choice not in DTYPES:
        raise DeviceError(f"--dtype {choice!r}: choose bf16, fp32 or auto")
    return choice


def torch_dtype(name: str):
    """ "bf16" -> torch.bfloat16, "fp32" -> torch.float32 (what torch, FSDP2 and vLLM are given)."""
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def problems(cfg) -> list[str]:
    """For prepare.check: the one-line error, if any (no GPU query when neither flag is given)."""
    try:
        layout_for(cfg)
    except DeviceError as err:
        return [str(err)]
    return []


def enter_generator_devices(settings, kv_cache_mb: int) -> dict:
    """vLLM's placement and memory options (AsyncEngineArgs keywords) for the generator's `settings`
    (config.GeneratorSettings). On GPUs it sets CUDA_VISIBLE_DEVICES first, before vLLM is imported
    (its engine and worker processes inherit it): vLLM runs on the first tensor_parallel_size
    visible GPUs; the trainer's weight buffer is on one of them or on the last one, where the worker
    extension opens its CUDA IPC handle and copies peer-to-peer. CUDA graphs on GPUs (weight reloads
    copy into the same storage, so captured graphs stay valid); on the CPU eager starts fastest
    (torch.compile adds ~20 s)."""
    if settings.device != "cuda":
        return dict(kv_cache_memory_bytes=kv_cache_mb * 2**20, enforce_eager=True)
    os.environ["CUDA_VISIBLE_DEVICES"] = settings.cuda_visible_devices
    return dict(
        gpu_memory_utilization=settings.gpu_memory_utilization,
        tensor_parallel_size=settings.tensor_parallel_size,
        enforce_eager=False,
    )


# vLLM 0.32's cap on the sequences in one engine step when nothing sets it (SchedulerConfig's
# default, which AsyncLLM.from_engine_args keeps).
VLLM_DEFAULT_MAX_NUM_SEQS = 128
# The most sequences one engine step may run: vLLM's own default for an H100/H200 in offline use
# (each sequence holds a row of the sampler's buffers beside its KV cache). Below vLLM's default
# of 2,048 tokens per engine step, which must leave room for one token of each sequence.
MAX_NUM_SEQS = 1024


def engine_concurrency(cfg) -> dict:
    """vLLM's scheduler caps (AsyncEngineArgs keywords): room in one engine step for every sample of
    the groups a step keeps in flight (--max-inflight-groups or --prompts-per-step, x --group-size),
    so they generate in one wave: at vLLM's default of 128 the default run's 32 x 8 samples ran in
    two, and a request waited 0.24-0.33 s for its first token. At most MAX_NUM_SEQS (a note says
    so); the KV cache still bounds what runs at once."""
    in_flight = (cfg.max_inflight_groups or cfg.prompts_per_step) * cfg.group_size
    seqs = min(max(VLLM_DEFAULT_MAX_NUM_SEQS, in_flight), MAX_NUM_SEQS)
    if in_flight > seqs:
        print(
            f"note: vLLM runs at most {seqs} sequences at once; a step keeps {in_flight} in "
            f"flight, so they generate in {-(-in_flight // seqs)} waves",
            file=sys.stderr,
            flush=True,
        )
    return dict(max_num_seqs=seqs)


def rank_device(layout: DeviceLayout, rank: int, torchrun: bool = False) -> torch.device:
    """A trainer rank's device: the layout's, or under torchrun (--role trainer) this node's GPU
    LOCAL_RANK."""
    if torchrun and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(layout.train_device(rank))


def enter_rank_device(layout: DeviceLayout, rank: int, device: torch.device) -> None:
    """Make a trainer rank's GPU current, capped to its share of a GPU it shares with vLLM (nothing
    on the CPU path). Call it only once vLLM has started on a shared GPU: vLLM measures the free
    memory as it starts."""
    if not layout.on_gpu:
        return
    torch.cuda.set_device(device)
    if layout.shares_gpu(rank):
        torch.cuda.set_per_process_memory_fraction(layout.train_memory_fraction, device)


# vLLM 0.32's CPU attention (CPUAttentionBackend.get_supported_head_sizes): another head size starts
# the engine and then fails at the first forward pass, inside the worker.
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


# The names MoE configs give their number of experts.
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def engine_problems(
    model_path: str,
    on_gpu: bool,
    max_model_len: int,
    max_new_tokens: int,
    kv_cache_mb: int,
    dtype: str,
    lora_rank: int = 0,
) -> list[str]:
    """What would stop vLLM from serving `model_path` with these settings, found from its
    config.json before anything starts (vLLM itself finds it inside its worker, as a stack trace):
    one line each."""
    config = AutoConfig.from_pretrained(model_path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    problems = []
    if not on_gpu and head_dim is not None and head_dim not in CPU_ATTENTION_HEAD_SIZES:
        problems.append(
            f"{model_path}: attention head size {head_dim} (hidden_size / num_attention_heads) is "
            f"not one vLLM's CPU backend runs ({', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))}); "
            "use such a model, or GPUs (--gen-devices/--train-devices)"
        )
    positions = getattr(text, "max_position_embeddings", None)
    # a scaled RoPE (YaRN...) lets vLLM go past these positions
    scaling = getattr(text, "rope_scaling", None) or {}
    scaled = (
        isinstance(scaling, dict)
        and scaling.get("rope_type", scaling.get("type", "default")) != "default"
    )
    if max_model_len and positions and max_model_len > positions and not scaled:
        problems.append(
            f"--max-model-len {max_model_len} is longer than {model_path} was built for "
            f"(max_position_embeddings {positions})"
        )
    context = max_model_len or positions
    if context and context <= max_new_tokens:
        problems.append(
            f"--max-new-tokens {max_new_tokens} fills the whole context ({context} tokens) of "
            f"{model_path}: lower it (or raise --max-model-len)"
        )
    if lora_rank and not on_gpu and any(getattr(text, name, None) for name in EXPERT_COUNTS):
        problems.append(
            f"{model_path} is a Mixture-of-Experts model: vLLM 0.32 runs MoE layers under LoRA "
            "only with its Triton kernels, which its CPU backend lacks (the engine fails at its "
            "first step): train it without --lora-rank here, or on GPUs"
        )
    window = getattr(text, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(text, "layer_types", None) or [])
    if (
        getattr(text, "model_type", "") in ("cohere2", "cohere2_moe")
        and sliding
        and context
        and context > window
    ):
        # vLLM 0.32 (commandr.py, cohere2_moe.py) lets a sliding layer see sliding_window + 1 tokens
        # (Cohere's training convention), transformers 5 sliding_window: a tiny Cohere2-MoE measured
        # 0.14 apart in log-prob.
        problems.append(
            f"{model_path}: vLLM serves its sliding-window layers one token wider than "
            f"transformers ({window} + 1 against {window}), so sequences longer than {window} "
            "tokens would be scored on another distribution than sampled: "
            f"give --max-model-len {window} or less"
        )
    per_token = kv_bytes_per_token(text, dtype)
    if not on_gpu and context and per_token:
        # A lower bound (vLLM also rounds up to 128-token blocks
        # and holds one back): refuse only the sure cases.
        needed_mb = context * per_token / 2**20
        if needed_mb > kv_cache_mb:
            problems.append(
                f"one sequence of {context} tokens (--max-model-len, or the model's "
                f"max_position_embeddings) needs at least {needed_mb:.0f} MB of KV cache, more "
                f"than --kv-cache-mb {kv_cache_mb}: raise --kv-cache-mb or lower --max-model-len"
            )
    return problems
