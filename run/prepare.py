"""run/prepare.py — what a run settles before any process starts (a reader may skip it).

Role: `parse_args` is train.py's command line: config's checks of the flags and `check`'s, which
load what the flags name (datasets, reward functions, --env, --tools, chat templates, devices), all
before anything starts, one line per problem. `resolve` turns the validated flags into the run's
final, frozen `Config` (--dtype auto, the ranks the devices give, the threads, no evaluation
without held-out prompts); `prepare_run` finds or builds the model, resolves --resume, checks the
tokenizer (and --teacher's against it), the LM head (heads.py) and that vLLM can serve the model,
and writes OUT/config.json; `generator_settings` is what the
generator process starts with. Data contract: `Prepared` (the weights to start from, the original
model, where a resume continues, the device layout, the teacher) is computed once in the parent and
passed to every child. May touch: OUT/config.json, OUT/init_model (the tiny default model) and
OUT/init_moe_model (--model TINY_MOE); reads the checkpoint's trainer_state.json.
"""

import dataclasses
import json
import os
import sys
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from config import Config, GeneratorSettings
from generator.shared_weights import SharedWeights, make_layout, named_shapes_of, packed_numel
from infra import devices
from run import flag_checks
from tasks import chat, envs, prompts, rewards, tools
from tasks.builtin import TINY_MOE, TINY_MOE_EXPERTS, build_tiny_model
from tasks.datasets import DataError
from trainer import checkpoint, heads, lora, packing, replay


def parse_args(argv=None) -> Config:
    """The command line as a checked Config: config's checks of the flags, then `check`'s, one error
    line each (SystemExit)."""
    cfg = flag_checks.config_of(argv)
    flag_checks.validate(cfg, check(cfg))
    return cfg


def check(cfg: Config) -> list[str]:
    """What keeps the flags from running that only loading what they name shows, one line per
    problem: the chat template files, the data (files exist, rows complete), the reward functions,
    --tools and --env (a factory function is called once, here), the devices, --packing on."""
    problems = []
    for text, read in (
        (cfg.chat_template, chat.read_template),
        (cfg.chat_template_kwargs, chat.template_kwargs),
    ):
        try:
            if text:
                read(text)
        except chat.TemplateError as e:
            problems.append(str(e))
    problems += prompts.check_flags(cfg)  # data flags: files exist, rows complete
    problems += rewards.check(cfg)  # --reward: every function imports
    problems += tools.check(cfg)  # --tools: every function imports and has a schema
    problems += envs.check(cfg)  # --env: it loads, has reset, and step (or tools)
    problems += devices.problems(cfg)  # --gen/train-devices: parse, GPUs exist, one rank per GPU
    # --packing on where no model can pack (a model that cannot: train.py's start finds out)
    if cfg.packing == "on" and packing.static_problem():
        problems.append(f"--packing on: {packing.static_problem()}")
    return problems


def resolve(cfg: Config) -> Config:
    """The run's config with nothing left open, decided once here; nothing changes it afterwards."""
    layout = devices.layout_for(cfg)
    eval_every = cfg.eval_every
    if eval_every and not prompts.has_eval_set(cfg):
        print(
            "note: no held-out prompts (a dataset file has no test split): no evaluation; give "
            "--eval-dataset FILE or a Hugging Face dataset with a test split (or --eval-split)",
            file=sys.stderr,
            flush=True,
        )
        eval_every = 0
    cores = len(os.sched_getaffinity(0))
    gen_threads = cfg.gen_threads or max(1, cores // 2)
    train_ranks = layout.world_size  # on GPUs: one rank per --train-devices GPU
    train_threads = cfg.train_threads or max(1, (cores - gen_threads) // train_ranks)
    return dataclasses.replace(
        cfg,
        dtype=devices.resolve_dtype(cfg.dtype, layout),
        eval_every=eval_every,
        train_ranks=train_ranks,
        gen_threads=gen_threads,
        train_threads=train_threads,
    )


@dataclass(frozen=True)
class Prepared:
    """What `prepare_run` found; the same for every process of the run."""

    # the weights the processes load: the original model (a resume's come from its checkpoint)
    model_path: str
    base_model: str  # the model the run first started from (tokenizer, LoRA base, KL reference)
    layout: devices.DeviceLayout
    resume_dir: str = ""
    start_step: int = 0
    start_version: int = 0
    # groups rejected whole before the resume (the walk of prompts continues after them)
    groups_dropped: int = 0
    teacher_model: str = ""  # --teacher, resolved to a local directory ("": no distillation)


def prepare_run(cfg: Config, engine_here: bool = True) -> Prepared:
    """Resolve the resume, find or build the model, check it, write OUT/config.json. `engine_here`:
    vLLM runs on this machine (a generator on another one checks its own engine)."""
    os.makedirs(cfg.out, exist_ok=True)
    resume = {}
    if cfg.resume:
        resume_dir = checkpoint.resolve(cfg.resume, cfg.out)
        saved = checkpoint.load_state(resume_dir)
        for line in checkpoint.config_differences(saved["config"], dataclasses.asdict(cfg)):
            print(f"warning: config differs from the checkpoint's: {line}", file=sys.stderr)
        print(
            f"resuming from {resume_dir}: step {saved['step']}, version {saved['version']}",
            flush=True,
        )
        # The model the run started from, kept through every resume (checkpoints rotate away).
        base_model = saved.get("base_model", "")
        if not os.path.isdir(base_model):
            raise SystemExit(
                f"error: the model {resume_dir} was trained from ({base_model or 'not recorded'}) "
                f"is gone: it holds the tokenizer (and the LoRA base / KL reference)"
            )
        # Every process loads the original model; the trainer then loads the checkpoint's sharded
        # state into its ranks and publishes it to the generator first (run_weights: starts_empty)
        model_path = base_model
        resume = dict(
            resume_dir=resume_dir,
            start_step=saved["step"],
            start_version=saved["version"],
            groups_dropped=saved.get("groups_dropped", 0),
        )
    else:
        model_path = base_model = prepare_model(cfg)
    check_tokenizer(model_path, cfg)
    check_head(model_path)
    # a model whose routes the trainer cannot replay: one line, now
    if cfg.router_replay or cfg.router_record:
        problem = replay.problem(AutoConfig.from_pretrained(model_path))
        if problem:
            raise SystemExit(f"error: {model_path}: {problem}")
    teacher = check_teacher(cfg.teacher, model_path) if cfg.teacher else ""
    layout = devices.layout_for(cfg)
    # the full weights' buffer lies on vLLM's GPU: leave it room
    if layout.shared_gpus and not cfg.lora_rank:
        nbytes = (
            packed_numel(make_layout(model_shapes(model_path)))
            * devices.torch_dtype(cfg.dtype).itemsize
        )
        try:
            layout = devices.layout_for(cfg, devices.gpu_fraction(nbytes, layout.buffer_device))
        except devices.DeviceError as err:
            raise SystemExit(f"error: {err}") from None
    if engine_here:
        check_engine(model_path, cfg, layout)
    if layout.notice:
        print(layout.notice, file=sys.stderr, flush=True)
    with open(os.path.join(cfg.out, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)
    return Prepared(model_path, base_model, layout, teacher_model=teacher, **resume)


def prepare_model(cfg) -> str:
    """--model's local directory; with no --model the tiny default model, with TINY_MOE a tiny
    Qwen3-MoE, built once into OUT (random weights from --seed, the copy task's tokenizer)."""
    if cfg.model and cfg.model != TINY_MOE:
        return local_model("--model", cfg.model)
    path = os.path.abspath(os.path.join(cfg.out, "init_moe_model" if cfg.model else "init_model"))
    if not os.path.exists(os.path.join(path, "config.json")):
        build_tiny_model(path, seed=cfg.seed, experts=TINY_MOE_EXPERTS if cfg.model else 0)
    return path


def check_tokenizer(model_path, cfg=None) -> None:
    """The run needs an end-of-sequence token (completions must be able to stop); an episode run a
    chat template it can extend turn by turn (chat.template_problem); --tools a template that
    renders tools and a vLLM tool parser that reads the calls it writes
    (tools.parser_problem). --chat-template(-kwargs) apply throughout."""
    try:
        tokenizer = chat.load_tokenizer(
            model_path, getattr(cfg, "chat_template", ""), getattr(cfg, "chat_template_kwargs", "")
        )
    except chat.TemplateError as err:
        raise SystemExit(f"error: {err}") from None
    except Exception as err:
        raise SystemExit(f"error: cannot load the tokenizer of {model_path}: {err}") from None
    vocab = getattr(AutoConfig.from_pretrained(model_path), "vocab_size", None)
    eos = tokenizer.eos_token_id
    if eos is None or (vocab is not None and eos >= vocab):
        raise SystemExit(
            f"error: the tokenizer in {model_path} has no eos token the model knows (eos "
            f"{tokenizer.eos_token!r}, id {eos}, model vocabulary {vocab}): completions could "
            "never stop; set eos_token in its tokenizer_config.json"
        )
    if cfg is None or not (cfg.tools or cfg.env):
        return
    with_tools = envs.runs_tools(cfg)
    schemas = (
        (tools.tool_schemas(tools.load_functions(cfg.tools)) if cfg.tools else [tools.PROBE_SCHEMA])
        if with_tools
        else None
    )
    problem = tools.tokenizer_problem(tokenizer, model_path) if with_tools else None
    if problem is None and getattr(tokenizer, "chat_template", None):
        problem = chat.template_problem(tokenizer, schemas)
    if problem is None and with_tools:
        try:
            parser = tools.ToolCallParser(
                tools.parser_name(cfg.tool_parser, tokenizer.chat_template),
                tokenizer,
                tools.reasoning_parser_name(cfg.reasoning_parser, tokenizer.chat_template),
            )
        except ValueError as err:
            problem = str(err)
        else:
            problem = tools.parser_problem(parser, tokenizer, model_path)
    if problem:
        raise SystemExit(f"error: {problem}")


def resolve_model(model: str) -> str:
    """A local model directory as it is; a hub id (`org/name`) downloaded once into the Hugging Face
    cache (so every process of the run reads the same files). Raises DataError with the reason when
    it fails."""
    if os.path.isdir(os.path.expanduser(model)):
        return os.path.abspath(os.path.expanduser(model))
    try:
        from huggingface_hub import snapshot_download  # only for a hub model id

        return snapshot_download(
            model,
            allow_patterns=[
                "*.json",
                "*.safetensors",
                "*.model",
                "*.txt",
                "*.jinja",
                "*.tiktoken",
                "*.py",
            ],
        )
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise DataError(
            f"--model {model}: not a local directory, and the hub download failed "
            f"({type(e).__name__}: {first})"
        ) from None


def hub_id_of(model: str) -> str:
    """--model as a hub id another node downloads for itself ("": a local directory, or a tiny model
    built into OUT, which a generator node reads from the same folder)."""
    return "" if model in ("", TINY_MOE) or os.path.exists(os.path.expanduser(model)) else model


def local_model(flag: str, name: str) -> str:
    """A --model/--teacher directory or hub id -> a local Hugging Face model directory (one line
    otherwise)."""
    try:
        path = resolve_model(name)  # a local directory, or a hub id downloaded once
    except DataError as err:
        raise SystemExit(f"error: {err}") from None
    if not os.path.exists(os.path.join(path, "config.json")):
        raise SystemExit(
            f"error: {flag} {name} has no config.json: not a Hugging Face model directory"
        )
    return path


def tokenizer_mismatch(student, teacher) -> str | None:
    """Why a teacher cannot score the student's token ids (None: it can): the same vocabulary
    (token -> id) and the same special tokens, or the teacher would read other tokens than the ones
    sampled."""
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])
        return (
            f"its vocabulary differs from the student's ({len(theirs)} tokens against {len(ours)}; "
            f"{len(differ)} token/id pairs differ, e.g. {differ[0][0]!r} -> {differ[0][1]})"
        )
    specials = [
        (name, getattr(student, name), getattr(teacher, name))
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    ]
    specials.append(
        ("special tokens", sorted(student.all_special_tokens), sorted(teacher.all_special_tokens))
    )
    for name, mine, its in specials:
        if mine != its:
            return f"its {name} differ from the student's ({its} against {mine})"
    return None


def check_teacher(name: str, student_path: str) -> str:
    """--teacher's local directory, checked: the student's tokenizer, a model vocabulary covering
    every id the student can sample, a head the trainer knows. One line otherwise, before anything
    starts."""
    path = local_model("--teacher", name)
    try:
        problem = tokenizer_mismatch(
            AutoTokenizer.from_pretrained(student_path), AutoTokenizer.from_pretrained(path)
        )
    except Exception as err:
        raise SystemExit(f"error: cannot load the tokenizer of --teacher {name}: {err}") from None
    ours, theirs = (
        getattr(AutoConfig.from_pretrained(p), "vocab_size", None) for p in (student_path, path)
    )
    if problem is None and ours is not None and theirs is not None and theirs < ours:
        problem = (
            f"its model vocabulary ({theirs}) is smaller than the student's ({ours}): "
            "ids it cannot score"
        )
    if problem:
        raise SystemExit(f"error: --teacher {name} cannot distill into {student_path}: {problem}")
    check_head(path)
    return path


def check_head(model_path) -> None:
    """The trainer scores tokens through the model's LM head as vLLM samples them: a head (a
    family's transform of the logits) it does not know would train on another distribution,
    silently. One line, now."""
    problem = heads.head_problem(AutoConfig.from_pretrained(model_path))
    if problem:
        raise SystemExit(f"error: {model_path}: {problem}")


def check_engine(model_path, cfg, layout) -> None:
    """A model or context vLLM cannot serve here (e.g. a head size its CPU backend lacks): one line,
    now."""
    problems = devices.engine_problems(
        model_path=model_path,
        on_gpu=layout.on_gpu,
        max_model_len=cfg.max_model_len,
        max_new_tokens=cfg.max_new_tokens,
        kv_cache_mb=cfg.kv_cache_mb,
        dtype=cfg.dtype,
        lora_rank=cfg.lora_rank,
    )
    if problems:
        raise SystemExit("error: " + "\nerror: ".join(problems))


def model_shapes(model_path) -> list[tuple[str, tuple[int, ...]]]:
    """The model's parameter names and shapes, from its config alone (a skeleton on the meta
    device)."""
    with torch.device("meta"):
        return named_shapes_of(
            AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
        )


def allocate_shared_weights(
    model_path, device="cpu", dtype=devices.MASTER_DTYPE, starts_empty=False
):
    """The packed buffer for the full weights, in the serving dtype (the trainer casts into it on
    publish)."""
    return SharedWeights.allocate(
        model_shapes(model_path), dtype=dtype, device=device, starts_empty=starts_empty
    )


def run_weights(cfg: Config, prepared: Prepared, device) -> tuple[SharedWeights, str]:
    """The run's packed buffer in the serving dtype: the full weights, or with --lora-rank the
    adapter's alone, and then the folder whose adapter_config.json tells vLLM the adapter's rank,
    alpha and targets ("": none). The generator serves nothing until it loads the trainer's first
    publish (`starts_empty`) when that is an adapter vLLM does not hold yet, or a resumed run's
    weights."""
    config, dtype = lora.config_of(cfg), devices.torch_dtype(cfg.dtype)
    starts_empty = config is not None or bool(prepared.resume_dir)
    if config is None:
        return allocate_shared_weights(prepared.model_path, device, dtype, starts_empty), ""
    shapes, resolved = lora.adapter_shapes(prepared.model_path, config)
    adapter_dir = lora.write_config(
        resolved, prepared.model_path, os.path.join(cfg.out, "adapter_config")
    )
    return SharedWeights.allocate(
        shapes, dtype=dtype, device=device, starts_empty=starts_empty
    ), adapter_dir


def generator_settings(cfg: Config, prepared: Prepared, lora_dir: str = "") -> GeneratorSettings:
    """The generator's start: the run's config and what the parent derived for it. A resumed run
    continues the sequence of group ids after the last one consumed (and so the walk of prompts),
    and serves the checkpoint's weights, which the trainer publishes at its start."""
    return GeneratorSettings(
        cfg,
        model=prepared.model_path,
        initial_version=prepared.start_version,
        first_group_id=prepared.start_step * cfg.prompts_per_step + prepared.groups_dropped,
        eval_at_start=cfg.eval_every > 0 and prepared.start_step == 0,
        lora_dir=lora_dir,
        stop=prompts.stop_strings(cfg.stop),
        **prepared.layout.generator_settings(),
    )
