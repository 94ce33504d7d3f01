"""The files a reader can copy out on their own: each, copied into an empty folder, imports only
torch and the standard library and works there in a fresh interpreter (`python -I`: no PYTHONPATH,
no repository on sys.path, the folder alone added).

To add a file: a `use_<name>` function below (it runs in that interpreter, so it imports only torch,
the standard library and the copied files, inside its body) and one entry in COPYABLE.
"""

import ast
import inspect
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def use_shared_weights():
    import torch
    import torch.multiprocessing as mp

    strategy = mp.get_sharing_strategy()
    import shared_weights

    assert mp.get_sharing_strategy() == strategy, (
        "importing shared_weights changed torch's sharing strategy"
    )
    shapes = [("a.weight", (3, 4)), ("b.bias", (5,))]
    shared = shared_weights.SharedWeights.allocate(shapes, dtype=torch.bfloat16)
    assert mp.get_sharing_strategy() == "file_system"  # selected before the buffer is shared
    values = {"a.weight": torch.randn(3, 4), "b.bias": torch.randn(5)}
    shared.publish(values, version=3)
    out = torch.empty_like(shared.buffer)
    assert shared.read_snapshot(out) == 3 and shared.version() == 3
    for slot in shared.layout:
        assert torch.equal(shared.view(slot, out), values[slot.name].to(torch.bfloat16))
    # the bytes another process would get map the same
    # memory: a write through one is read through the other
    received = shared_weights.SharedWeights.from_bytes(shared.to_bytes())
    received.publish({"a.weight": torch.ones(3, 4), "b.bias": torch.zeros(5)}, version=4)
    assert shared.read_snapshot(out) == 4 and float(out.sum()) == 12.0


def use_logprobs():
    import logprobs
    import torch

    torch.manual_seed(0)
    vocab, width = 11, 8

    # any module whose output's first element is the final hidden states
    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.mix = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, width)

        def forward(self, input_ids):
            return (torch.tanh(self.mix(self.embed(input_ids))),)

    class TinyLM(torch.nn.Module):  # Hugging Face's call convention, in plain torch
        def __init__(self):
            super().__init__()
            self.decoder, self.lm_head = Decoder(), torch.nn.Linear(width, vocab)

        def forward(self, input_ids, attention_mask=None, use_cache=False, logits_to_keep=None):
            # no logits kept
            return self.lm_head(self.decoder(input_ids)[0][:, : len(logits_to_keep)])

    model = TinyLM()
    ids = torch.randint(0, vocab, (2, 7))
    targets, mask = ids[:, 1:], torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    logp, entropy, full = logprobs.score_tokens(
        model,
        model.decoder,
        model.lm_head,
        ids,
        torch.ones_like(ids),
        targets=targets,
        mask=mask,
        temperature=0.7,
        top_k=4,
        untruncated=True,
    )
    logits = model.lm_head(model.decoder(ids)[0])[:, :-1]
    truncated = logprobs.token_logprobs(logits, targets, 0.7, top_k=4)
    assert torch.allclose(logp[mask], truncated[mask], atol=1e-5)
    untruncated = logprobs.token_logprobs(logits, targets, 0.7)
    assert torch.allclose(full[mask], untruncated[mask], atol=1e-5)
    assert (logp[~mask] == 0).all() and (entropy[mask] > 0).all()
    kept = mask & torch.isfinite(logp)
    torch.where(kept, logp, 0.0).sum().backward()  # through the chunked head's closed-form backward
    assert (
        model.lm_head.weight.grad.abs().sum() > 0 and model.decoder.mix.weight.grad.abs().sum() > 0
    )


def use_losses():
    import torch

    import losses

    torch.manual_seed(0)
    logp = (-torch.rand(2, 6) * 3).requires_grad_()
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    logp_inf = torch.where(torch.arange(6) == 5, -float("inf"), logp)  # outside the kept set
    inputs = losses.LossInputs(
        logp=logp_inf,
        behaviour_logp=logp.detach() - 0.1,
        advantages=torch.tensor([1.0, -1.0]),
        mask=mask,
        logp_untruncated=logp,
        ref_logp=logp.detach() + 0.2,
    )
    loss, terms = losses.grpo_loss(inputs, losses.LossSettings(kl_coef=0.1))
    loss.backward()
    assert logp.grad[mask & (torch.arange(6) < 5)].abs().min() > 0 and (logp.grad[:, 5] == 0).all()
    assert terms.outside.tolist() == [[False] * 5 + [True], [False] * 6]
    assert float(terms.policy["ratio_mean"]) == 1.0 and (terms.kl[terms.mask] > 0).all()


def use_advantages():
    import torch

    import advantages

    rewards, scored = (
        torch.tensor([[1.0, 0.0, 0.5, 0.5]]),
        torch.tensor([[True, True, False, False]]),
    )
    for estimator in advantages.ADV_ESTIMATORS:
        got = advantages.estimate_advantages(rewards, estimator, scored=scored)
        assert got[0, 2:].tolist() == [0.0, 0.0] and got[0, 0] > 0 > got[0, 1], estimator


def use_tracing():
    import json
    import os
    import tempfile

    import trace_merge
    import tracing

    out = tempfile.mkdtemp()
    tracing.configure(out, steps=10)  # (a run's parent; its children inherit the environment)
    assert tracing.start("worker") is not None
    t0 = tracing.clock()
    tracing.complete("work", t0, t0 + 0.5, items=3)
    tracing.counter("queue", depth=2)
    tracing.flush()
    tracing.unconfigure()
    events = json.load(open(trace_merge.merge(out, remove_parts=True)))["traceEvents"]
    assert [e["dur"] for e in events if e["ph"] == "X"] == [500000.0] and not os.path.exists(
        f"{out}/trace"
    )
    assert {
        e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"
    } == {"worker"}


def use_trace_merge():
    import trace_merge

    steps = [
        {"ph": "X", "cat": "step", "ts": 10.0 * i, "dur": 5.0, "args": {"rank": 0}}
        for i in range(4)
    ]
    assert (
        trace_merge.last_steps(steps, 2) == steps[2:] and trace_merge.last_steps(steps, 9) == steps
    )


COPYABLE = {
    "generator/shared_weights.py": use_shared_weights,
    "losses.py": use_losses,
    "trainer/logprobs.py": use_logprobs,
    "advantages.py": use_advantages,
    "infra/tracing.py": use_tracing,
    "run/trace_merge.py": use_trace_merge,
}


def imported_roots(path: str) -> set[str]:
    """Every module the file imports, anywhere in it (top-level package names)."""
    roots = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_each_copyable_file_imports_only_torch_and_the_standard_library():
    for name in COPYABLE:
        others = (
            imported_roots(os.path.join(REPO, name))
            - set(sys.stdlib_module_names)
            - {"torch", "__future__"}
        )
        assert not others, f"{name} imports {sorted(others)}"


def test_copyable_files_work_alone_in_an_empty_folder(tmp_path):
    for name in COPYABLE:
        shutil.copy(os.path.join(REPO, name), tmp_path / os.path.basename(name))
    modules = [os.path.basename(name)[:-3] for name in COPYABLE]
    script = "\n".join(
        [
            "import os, sys",
            f"sys.path.insert(0, {str(tmp_path)!r})",
            f"assert {REPO!r} not in [os.path.abspath(p) for p in sys.path]",
            *(inspect.getsource(use) + f"\n{use.__name__}()" for use in COPYABLE.values()),
            f"assert all(os.path.dirname(sys.modules[m].__file__) == {str(tmp_path)!r} for m in "
            f"{modules!r})",
            "print('ok')",
        ]
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_config_offers_the_values_the_copyable_files_take():
    """config.py imports nothing of the project, so it holds its own copy of the choices losses.py
    and advantages.py check: the two must agree."""
    import advantages
    import config
    import losses

    assert config.LOSS_CHOICES == {
        "loss": losses.VARIANTS,
        "agg": losses.AGGS,
        "kl_kind": losses.KL_KINDS,
        "is_level": losses.IS_LEVELS,
        "is_mode": losses.IS_MODES,
        "adv_scale": advantages.SCALES,
        "adv_estimator": advantages.ADV_ESTIMATORS,
    }
