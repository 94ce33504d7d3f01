"""No silent disagreement (issue 39): trainer and generator agree on a run's first on-policy batch,
or the run does not go on.

- Every family the suite builds (tests/test_moe.py's Mixture-of-Experts families, tests/
  test_heads.py's dense ones) in the settings those files do not serve already: tied embeddings
  where they serve untied ones and the other way round, norm_topk_prob flipped where the family has
  it. vLLM samples at start, through the project's worker extension (one spawned child, one engine
  per model in turn), and the trainer scores what it sampled here (fp32): each agrees <= 1e-4, or
  `heads.head_problem` refuses the config in one line before anything starts. A tiny OLMoE as a
  user builds it (8 experts, top-2, norm_topk_prob false, tied embeddings) was 1.40 nats off in a
  `train.py` run (NaN here) before vllm_worker tied the LM head vLLM's OLMoE never ties; GLM-4-MoE
  and AFMoE tied were 3.4 and 0.79 off; OLMo-2 (vLLM's Transformers backend) could not attach the
  weight buffer at all.
- `metrics.first_batch_check`: fp32 stops above its bound (and on NaN), bf16 warns.
- A trainer rank whose first on-policy batch disagrees stops the run in one line naming the model's
  family and the figure, exit 1 (`train.check_first_agreement` on two ranks under
  `processes.run_children`).
"""

import math
import os
import sys
import time
from types import SimpleNamespace

import pytest
import test_heads
import test_moe
import torch
import transformers
from spawned import end_in_process_engine, result_of_child, served_llm

import buffer
import update
from run import metrics
from tasks import builtin
from trainer import heads

ENGINE_TIMEOUT_S = 900
DENSE_HEAD_GAIN = 4.0  # sharp enough that a wrong head shows, sampling still random
# name -> (model type, config values over the family's in test_moe.py / test_heads.py): the settings
# no engine of the suite serves (tests/test_moe.py: MoE untied but cohere2_moe, norm_topk_prob at
# the family's default; the tiny qwen2 and llama models tied; test_heads.py: granite and
# gemma3_text untied, gemma2 and cohere tied); dense families as their released models mostly are
# (mistral, qwen3 and granite behind vLLM's llama-like classes, all agreeing in both settings when
# swept once: see the commit that added this file)
VARIANTS = {
    # the model, as a user builds it
    "olmoe tied, 8 experts": ("olmoe", dict(tie_word_embeddings=True, num_experts=8)),
    "olmoe norm_topk_prob": ("olmoe", dict(norm_topk_prob=True)),
    "glm4_moe tied, no norm_topk_prob": (
        "glm4_moe",
        dict(tie_word_embeddings=True, norm_topk_prob=False),
    ),
    "afmoe tied": ("afmoe", dict(tie_word_embeddings=True)),
    "qwen3_moe tied, norm_topk_prob": (
        "qwen3_moe",
        dict(tie_word_embeddings=True, norm_topk_prob=True),
    ),
    "qwen2_moe tied, norm_topk_prob": (
        "qwen2_moe",
        dict(tie_word_embeddings=True, norm_topk_prob=True),
    ),
    "exaone_moe tied, no norm_topk_prob": (
        "exaone_moe",
        dict(tie_word_embeddings=True, norm_topk_prob=False),
    ),
    "mixtral tied": ("mixtral", dict(tie_word_embeddings=True)),
    "granitemoe tied": ("granitemoe", dict(tie_word_embeddings=True)),
    "granitemoeshared tied": ("granitemoeshared", dict(tie_word_embeddings=True)),
    "ernie4_5_moe tied": ("ernie4_5_moe", dict(tie_word_embeddings=True)),
    "cohere2_moe sigmoid, no norm_topk_prob": (
        "cohere2_moe",
        dict(expert_selection_fn="sigmoid", norm_topk_prob=False),
    ),
    "cohere2_moe softmax, no norm_topk_prob": ("cohere2_moe", dict(norm_topk_prob=False)),
    "cohere2_moe untied": ("cohere2_moe", dict(tie_word_embeddings=False)),
    "llama untied": ("llama", dict(tie_word_embeddings=False)),
    "phi3 untied": ("phi3", dict(tie_word_embeddings=False)),
    "gemma tied": ("gemma", dict(tie_word_embeddings=True)),
    "gemma3_text tied": ("gemma3_text", dict(tie_word_embeddings=True)),
    "gemma2 untied": ("gemma2", dict(tie_word_embeddings=False)),
    "cohere untied": ("cohere", dict(tie_word_embeddings=False)),
    # served by vLLM's Transformers backend, which changes transformers' own class in its process:
    # the last engine of the child
    "olmo2 untied": ("olmo2", dict(tie_word_embeddings=False)),
}
# refused before the start, in one line (heads.head_problem): what each line says
REFUSED = {
    "olmoe norm_topk_prob": "never renormalizes",
    "cohere2_moe softmax, no norm_topk_prob": "without renormalizing",
    "cohere2_moe untied": "tie_word_embeddings false",
    "gemma2 untied": "tie_word_embeddings false",
    "cohere untied": "tie_word_embeddings false",
}


def tiny_variant(model_type: str, overrides: dict):
    """The family's tiny model as test_moe.py or test_heads.py builds it (the copy task's 26-token
    vocabulary), with `overrides`."""
    if model_type in test_moe.MOE_FAMILIES:
        values = {**test_moe.SHAPE, **test_moe.MOE_FAMILIES[model_type], **overrides}
    else:
        values = {**test_heads.SHAPE, **test_heads.FAMILIES[model_type], **overrides}
        values["vocab_size"] = test_moe.VOCAB
    config = transformers.AutoConfig.for_model(model_type, **values)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # routers sharpened, as test_moe.tiny_moe does
            if p.dim() == 2 and name.endswith(
                ("gate.weight", "router.weight", "router.layer.weight")
            ):
                p.mul_(test_moe.ROUTER_GAIN)
        if model_type not in test_moe.MOE_FAMILIES:
            model.get_output_embeddings().weight.mul_(DENSE_HEAD_GAIN)
    return model


def sample_at_start(models: dict) -> dict:
    """In a child: for each model, a vLLM engine as the generator starts one (the worker extension,
    the weight buffer attached) samples 8 prompts x 4 completions of 5 tokens; per model the samples
    (prompt, tokens, vLLM's log-probs) and the seconds it took. The trainer scores them in the
    test's process: vLLM's Transformers backend changes transformers' own classes where it runs."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    from run import prepare

    out = {}
    for name, path in models.items():
        start = time.perf_counter()
        shared = prepare.allocate_shared_weights(path)  # (before the engine changes any class)
        llm = served_llm(path)
        llm.collective_rpc("attach_shared_weights", args=(shared.to_bytes(),))
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, test_moe.VOCAB, (4,), generator=g).tolist() for _ in range(8)]
        params = SamplingParams(n=4, max_tokens=5, temperature=1.0, logprobs=0, seed=0)
        requests = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        out[name] = {
            "samples": [
                (prompt, list(c.token_ids), [s[t].logprob for s, t in zip(c.logprobs, c.token_ids)])
                for prompt, request in zip(prompts, requests)
                for c in request.outputs
            ],
            "seconds": time.perf_counter() - start,
        }
        llm = None
        end_in_process_engine()
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """VARIANTS written with the copy tokenizer: {name: (path, heads.head_problem of it)}."""
    out = {}
    for name, (model_type, overrides) in VARIANTS.items():
        path = builtin.build_tiny_model(str(tmp_path_factory.mktemp("variant") / "model"))
        model = tiny_variant(model_type, overrides)
        model.save_pretrained(path)
        out[name] = (path, heads.head_problem(transformers.AutoConfig.from_pretrained(path)))
    return out


@pytest.fixture(scope="module")
def sampled(built):
    """sample_at_start over the variants not refused, in one spawned child."""
    served = {name: path for name, (path, problem) in built.items() if not problem}
    return result_of_child(sample_at_start, (served,), ENGINE_TIMEOUT_S)


@pytest.mark.parametrize("name", VARIANTS)
def test_every_family_agrees_at_its_first_step_or_is_refused_in_one_line(name, built, sampled):
    path, problem = built[name]
    if name in REFUSED:
        assert problem.startswith("model type ") and REFUSED[name] in problem, problem
        assert "\n" not in problem
        return
    assert problem == "", problem
    got = sampled[name]
    samples = [
        buffer.Sample(p, ids, lps, [1] * len(lps), 0.0, 1.0) for p, ids, lps in got["samples"]
    ]
    batch = buffer.collate(samples, pad_id=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = update.completion_logprobs(model, batch, 1.0).logp
    diff = float((logp - batch.behaviour_logp)[batch.mask].abs().max())
    print(f"{name}: max |trainer - vLLM| log-prob at start {diff:.1e} ({got['seconds']:.1f} s)")
    assert int(batch.mask.sum()) >= 100
    assert diff <= 1e-4, diff  # (NaN fails too)


# --------------------------------------------------------------------------------------------------
# The check at a run's first on-policy batch
# --------------------------------------------------------------------------------------------------
FAMILY = "model type 'olmoe', OlmoeForCausalLM"


def test_the_first_batch_stops_an_fp32_run_and_warns_a_bf16_one():
    bound = metrics.FIRST_BATCH_BOUND_FP32
    # the suite's families agree within 1e-4; the smallest disagreement measured was 2.3e-3
    assert 1e-4 < bound / 5 and bound < 2.3e-3 / 2
    assert metrics.first_batch_check(6.3e-5, "fp32", FAMILY, 0) == ("", "")
    assert metrics.first_batch_check(bound, "fp32", FAMILY, 0) == ("", "")
    for figure in (1.40, math.nan):
        verdict, line = metrics.first_batch_check(figure, "fp32", FAMILY, 0)
        assert verdict == "stop" and line.startswith("error: ") and "\n" not in line
        assert FAMILY in line and ("1.4 " in line or "nan" in line), line
    verdict, line = metrics.first_batch_check(0.022, "bf16", FAMILY, 3)
    assert verdict == "warn" and "0.022" in line and "step 3" in line and "--dtype fp32" in line
    assert metrics.first_batch_check(math.nan, "bf16", FAMILY, 0)[0] == "stop"
    assert metrics.first_batch_check(4e-4, "bf16", FAMILY, 0) == ("", "")


def stub_rank(model_path: str, rank: int = 0, dtype: str = "fp32"):
    import train

    trainer = train.Rank.__new__(train.Rank)
    trainer.cfg = SimpleNamespace(dtype=dtype)
    trainer.prepared = SimpleNamespace(model_path=model_path)
    trainer.rank, trainer.agreement_checked = rank, False
    return trainer


def test_only_the_first_on_policy_batch_is_judged(tmp_path, capsys):
    import train

    tiny_variant("olmoe", dict(tie_word_embeddings=True)).save_pretrained(tmp_path)
    capsys.readouterr()
    trainer = stub_rank(str(tmp_path))
    # a first step without an on-policy row: the next step that has one is the first judged
    train.check_first_agreement(trainer, 0, None)
    assert not trainer.agreement_checked
    train.check_first_agreement(trainer, 1, 5e-7)
    assert trainer.agreement_checked
    train.check_first_agreement(trainer, 2, 1.40)  # judged once: later figures are the log's
    bf16 = stub_rank(str(tmp_path), dtype="bf16")
    train.check_first_agreement(bf16, 0, 0.03)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: ") and FAMILY in err, err
    with pytest.raises(SystemExit) as stop:
        train.check_first_agreement(stub_rank(str(tmp_path)), 0, 1.40)
    assert str(stop.value).startswith("error: ") and FAMILY in str(stop.value)


def test_a_disagreeing_first_batch_stops_the_run_in_one_line(tmp_path, capsys):
    import torch.multiprocessing as mp

    import train
    from infra import processes

    tiny_variant("olmoe", dict(tie_word_embeddings=True)).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as stop:  # what each rank raises (test above)
        train.check_first_agreement(stub_rank(str(tmp_path)), 0, 1.40)
    capsys.readouterr()
    ctx = mp.get_context("spawn")
    # two ranks raising it (sys.exit: a child that imports
    # nothing more), a generator that outlives them
    children = {"generator": (time.sleep, (300,), True)}
    for rank in range(2):
        children[f"trainer{rank}"] = (sys.exit, (stop.value.code,), False)
    code = processes.run_children(ctx, children, ctx.Queue(), processes.make_control(ctx))
    err = capsys.readouterr().err
    assert code == 1
    [line] = err.strip().splitlines()  # both ranks stopped, with the same line
    assert line.startswith("error: trainer and generator log-probs differ by up to 1.4 ")
    assert FAMILY in line and "fp32" in line and "Traceback" not in err
