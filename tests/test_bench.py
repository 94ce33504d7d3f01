"""Every benchmark script (bench/*.py with a main) at its smoke size (`--smoke`, given in each one's
docstring): it finishes (main returns 0), writes its result file with the fields it promises, and
its figures are finite; a file of several questions runs each entry (`--what NAME`). The harness
(common.py, machine.py) runs inside the scripts that use it.

The benchmarks run in this process; what they start (vLLM engines, trainer processes, ranks, probes)
is real, but shared where it is expensive:
- one real `python train.py` run, made by `bench/memory.py --what peak_rss --smoke` (in
  tests/conftest.py, shared with tests/test_trace.py), stands in for every train.py run a benchmark
  asks `common.run_train_cli` for: each one's flags go through train.py's own parser and checks
  (`prepare.parse_args`), and its OUT gets the recorded run's files (model/ linked);
- one real generation-alone recording (`overlap.generate_alone`) serves overlap.py and
  training.py;
- a smoke session (bench/machine.py) for the whole module: generation.py (both entries) and
  weight_sync.py run their measurements in this process on one vLLM engine for the tiny model (and
  one with LoRA), and models of the same seed and sizes are built once.
The vLLM engines started here run without a worker process beside their EngineCore (conftest.py sets
VLLM_ENABLE_V1_MULTIPROCESSING=0 for the suite, as bench/machine.py does). memory.py runs through
`ab.py --what all` (as `python bench/memory.py --smoke`); `ab.py --what report` reads what the
others wrote; gpu_trainer.py (a GPU's measurement, at its smoke size on the CPU) runs in a process
of its own, as it runs on a GPU machine.
"""

import importlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import config
from run import prepare

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import common  # noqa: E402
import costs  # noqa: E402
import machine  # noqa: E402
import overlap  # noqa: E402

# the scripts this module runs (memory.py through `ab.py
# --what all`); the rest of bench/ are helpers they import
SCRIPTS = {
    "overlap",
    "weight_sync",
    "generation",
    "training",
    "ab",
    "learning",
    "costs",
    "moe",
    "memory",
    "gpu_trainer",
}
HELPERS = {"common", "machine"}


def finite(*values):
    """Every value a finite number (a wrong key, a None or a NaN fails here)."""
    for v in values:
        assert isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), values
    return True


def positive(*values):
    return finite(*values) and all(v > 0 for v in values)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("bench_out")


@pytest.fixture(scope="module", autouse=True)
def session(tmp_path_factory):
    """The smoke session; afterwards, this process's torch threads as they were (benchmarks set
    their own)."""
    import torch

    threads = torch.get_num_threads()
    with machine.Session(tmp_path_factory.mktemp("session")) as s:
        yield s
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def recorded(recorded_run):
    """The one real train.py run (tests/conftest.py: bench/memory.py --what peak_rss): (its folder,
    peak_rss's figures)."""
    return recorded_run


@pytest.fixture(scope="module")
def runs(recorded):
    """`common.run_train_cli` replaying the recorded run; the list of the configs the benchmarks
    asked for."""
    run_dir, peak = recorded
    asked = []

    def run_train_cli(
        out_dir, args, timeout_s=900.0, cpu_window=None, repo=common.REPO, stop_on_timeout=False
    ):
        out_dir = Path(out_dir)
        # train.py's parser and checks
        asked.append(prepare.parse_args(["--out", str(out_dir), *args]))
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "summary.json", "trace.json"):
            shutil.copy(run_dir / name, out_dir / name)
        if not (out_dir / "model").exists():
            (out_dir / "model").symlink_to(run_dir / "model")  # a teacher for distill.py's students
        return {
            **common.read_run(out_dir),
            "process_s": peak["wall_s"],
            "cmd": " ".join(["train.py", *args]),
            "cores_by_role": None,
        }

    real_generate, generated = overlap.generate_alone, {}

    def generate_alone(cfg, model_path, steps, cpu_from_step=None):
        if not generated:  # the first caller's recording, with the CPU window overlap.py reads
            generated.update(
                real_generate(cfg, model_path, steps=steps, cpu_from_step=2), steps=steps
            )
        assert steps == generated["steps"], "the smokes share one recording: the same --steps"
        return dict(generated)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "run_train_cli", run_train_cli)
        mp.setattr(overlap, "generate_alone", generate_alone)
        yield asked


def smoke(name, out, *args, script=None):
    """`python bench/SCRIPT.py ARGS --smoke --out OUT` (SCRIPT: NAME unless given), in this
    process; the JSON NAME.json it wrote."""
    module = importlib.import_module(script or name)
    assert module.main([*args, "--smoke", "--out", str(out)]) == 0
    return json.loads((out / f"{name}.json").read_text())


def test_every_script_has_a_smoke_size_and_runs_here():
    files = {p.stem: p.read_text() for p in (REPO / "bench").glob("*.py")}
    assert {name for name, text in files.items() if "__main__" in text} == SCRIPTS and set(
        files
    ) == SCRIPTS | HELPERS
    # (each script has a smoke size)
    assert all("--smoke" in files[name] for name in SCRIPTS - {"report"})


def test_peak_rss_measures_the_recorded_run(recorded):
    run_dir, peak = recorded
    assert peak["exit_code"] == 0 and positive(
        peak["wall_s"], peak["peak_pss_sum_gib"], peak["peak_rss_sum_gib"]
    )
    # (the worker: in the core)
    assert {"parent", "child", "vllm_engine_core"} <= set(peak["peak_pss_by_role_gib"])
    rows = common.read_run(run_dir)["rows"]
    assert [r["step"] for r in rows if "step" in r][-1] == 11 and any(
        "eval/step" in r for r in rows
    )


def test_overlap(runs, out):
    runs.clear()
    data = smoke("overlap", out)
    assert [c.max_lag for c in runs] == [0, 1, 2, 4] and all(c.steps == 6 for c in runs)
    assert (
        positive(data["t_gen_s"], data["t_train_s"], data["cpu_bound"]) and 1 <= data["bound"] <= 2
    )
    # seconds a step, not minutes (issue 29: a loop sized by --max-lag 10**6)
    assert data["t_train_s"] < 10
    # (from the generation-alone run's trace)
    assert positive(data["alone"]["gen"]["engine_s_per_token"])
    parts = (
        "wait_swap",
        "wait_weights",
        "wait_idle",
        "wait_full_queue",
        "wait_generating",
        "evaluation",
        "train_contention",
    )
    for mode in data["modes"]:
        assert positive(
            data[mode]["steps_per_s"], data[mode]["speedup"], data[mode]["share_of_bound"]
        )
        # (the recorded run's trace): its parts add up to the share missing
        missing = data[mode]["missing"]
        assert finite(
            missing["missing"],
            missing["gen_contention"],
            missing["gen_swap"],
            *(missing[k] for k in parts),
        )
        assert abs(sum(missing[k] for k in parts) - missing["missing"]) < 0.02
        assert 0 <= missing["gen_contention"] <= max(0.0, missing["wait_generating"]) + 1e-9


def test_weight_sync(out):
    data = smoke("weight_sync", out)
    full, adapter = data["rows"]
    assert (full["name"], adapter["name"]) == ("tiny", "tiny LoRA r8") and full[
        "params"
    ] > 10 * adapter["params"]
    for row in (full, adapter):
        assert positive(
            row["sync_ms"], row["copy_ms"], row["memcpy_ms"], row["load_ms"], row["ratio"]
        )
        assert row["samples"] == 2
    prof = full["load_profile"]
    assert prof["engine_tensors_in_buffer"] == 0 and not prof["torn"] and prof["engine_tensors"] > 0
    assert positive(adapter["tmpfs_file"]["sync_ms"], adapter["ratio_to_full"])
    (cross,) = data["cross_machine"]
    assert cross["same_bytes"] and positive(
        cross["cross_ms"], cross["shm_publish_ms"], cross["cross_over_memcpy"]
    )
    (publish,) = data["publish"]  # at 2 ranks, each way against the per-parameter publish
    assert publish["ranks"] == 2 and publish["same_bytes"] == {
        "single_new": True,
        "multi_new": True,
    }
    assert positive(publish["single_new_over_old"], publish["multi_new_over_old"])


def test_generator(out):
    data = smoke("generator", out, script="generation")
    assert positive(
        data["ratio"],
        data["ratio_nosync"],
        data["bare_tokens_per_s"],
        data["pipeline_tokens_per_s"],
    )
    long = data["workloads"]["long"]
    assert positive(long["ratio"], long["ratio_keep"]) and long["sync_ms_median"] is not None
    assert (
        long["pipeline_mismatch"]["unswapped"]["tokens"]
        + long["pipeline_mismatch"]["after_swap"]["tokens"]
        > 0
    )


def test_env_latency(out):
    data = smoke("env_latency", out, "--what", "env_latency", script="generation")
    assert set(data["tokens_per_s"]) == {"pipeline", "sync", "sync32"}
    for rates in data["tokens_per_s"].values():
        assert set(rates) == {"0", "20", "100"} and positive(*rates.values())


def test_dtype(runs, out):
    runs.clear()
    data = smoke("dtype", out, "--what", "dtype", script="training")
    (row,) = data["rows"]
    assert positive(
        row["train_fp32"], row["train_bf16"], row["generate_fp32"], row["generate_bf16"]
    )
    assert [c.dtype for c in runs] == ["fp32", "bf16"] and all(c.max_lag == 0 for c in runs)
    assert [r["dtype"] for r in data["runs"]] == ["fp32", "bf16"] and positive(
        data["runs"][0]["steps_per_s"]
    )


def test_trainer(runs, out):
    data = smoke("trainer", out, script="training")
    (row,) = data["rows"]
    assert row["name"] == "tiny" and positive(
        row["ratio"], row["bare_tokens_per_s"], row["project_tokens_per_s"]
    )
    assert positive(row["project"]["train_ms_mean"], row["project"]["publish_ms_mean"])


def test_load_memory(tmp_path, out):
    assert (
        importlib.import_module("memory").main(
            ["--what", "load_memory", "--smoke", "--out", str(out), "--work", str(tmp_path)]
        )
        == 0
    )
    data = json.loads((out / "load_memory_2ranks.json").read_text())
    assert (
        "before" not in data
        and data["after"]["exit_code"] == 0
        and len(data["after"]["peak_rss_per_rank_gib"]) == 2
    )
    assert positive(data["after"]["peak_rss_sum_gib"], data["fp32_model_gib"])


def test_ab_finds_a_revision_equal_to_itself(runs, out):
    runs.clear()
    data = smoke("ab", out)
    assert data["settings"]["base"] == data["settings"]["head"] and len(runs) == 2
    assert data["exact"] and all(case["identical"] for case in data["exact"].values()), data[
        "exact"
    ]
    assert data["max_step_reward_diff"] == [0.0]  # the same recorded run on both sides


def test_learning(runs, out):
    runs.clear()
    data = smoke("learning", out, "--what", "learning", script="learning")
    assert [c.max_lag for c in runs] == [0, 4] and all(c.steps == 12 for c in runs)
    assert positive(data["wall_speedup"]) and data["runs"]["sync"]["steps"] == 12


def test_waves_and_holds_read_from_the_recorded_trace(recorded):
    run_dir, _ = recorded
    summary = json.loads((run_dir / "summary.json").read_text())
    got = costs.waves_and_holds(costs.load(run_dir / "trace.json"))
    assert 0 < got["max_seqs_per_engine_step"] <= summary["max_num_seqs"]
    assert got["engine_steps"] >= got["engine_steps_at_max"] > 0
    assert 0 <= got["queued_ms_p50"] <= got["queued_ms_p90"]
    assert all(h["publishes_during"] > 0 for h in got["eval_holds"])


def test_real_model(runs, out):
    runs.clear()
    data = smoke("real_model", out, "--what", "real_model", script="learning")
    (cfg,) = runs  # one run: the addition task's files, the math reward, held-out evaluation
    assert (cfg.reward, cfg.steps, cfg.eval_prompts) == ("math", 2, 20)
    assert Path(cfg.dataset).name == "train.jsonl" and Path(cfg.eval_dataset).name == "test.jsonl"
    assert data["prompt_tokens_mean"] > 0 and data["steps"]
    assert all(0 < s["prompt_share"] < 1 for s in data["steps"] if s["completion_tokens"])


def test_eval_cost(runs, out):
    runs.clear()
    data = smoke("eval_cost", out, "--what", "eval", script="costs")
    assert sorted(c.eval_every for c in runs) == [0, config.Config().eval_every]
    assert positive(data["cost_ratio"]) and data["runs"]["eval"][0]["evals"]


def test_trace_cost(runs, out):
    runs.clear()
    data = smoke("trace_cost", out, "--what", "trace", script="costs")
    assert [c.trace_steps for c in runs] == [300, 0] and all(c.steps == 12 for c in runs)
    assert positive(
        data["cost_ratio_wall"], data["cost_ratio_process"], data["kb_per_step"], data["draw_s"]
    )
    assert data["events_per_step"] > 10 and (out / "trace_cost.png").exists()


def test_stale_bias(runs, out):
    runs.clear()
    data = smoke("stale_bias", out, "--what", "stale_bias", script="learning")
    assert [c.stale_rule for c in runs] == ["group", "tokens"] and all(
        c.max_new_tokens == 8 for c in runs
    )
    assert all(data["runs"][rule]["steps"] == 12 for rule in ("group", "tokens"))


def test_variants(runs, out):
    runs.clear()
    data = smoke("variants", out, "--what", "variants", script="learning")
    assert [(c.loss, c.mini_batches) for c in runs] == [
        ("grpo", 1),
        ("grpo", 4),
        ("dapo", 4),
        ("cispo", 4),
    ]
    assert all(finite(r["reward_last20"], r["clip_frac"], r["ratio_max"]) for r in data["runs"])


def test_distill(runs, out):
    runs.clear()
    data = smoke("distill", out, "--what", "distill", script="learning")
    teacher, plain, distilled = runs
    assert not teacher.teacher and not plain.teacher and distilled.teacher.endswith("teacher/model")
    assert distilled.distill_coef == 0.1 and plain.seed == distilled.seed == 1
    assert positive(data["teacher"]["final_reward"], data["target"]) and set(data["runs"]) == {
        "grpo_seed1",
        "distill_seed1",
    }


def test_moe(runs, out):
    runs.clear()
    data = smoke("moe", out)
    assert [(c.model, c.router_record, c.router_replay) for c in runs] == [
        ("TINY_MOE", False, False),
        ("TINY_MOE", True, False),
        ("TINY_MOE", False, True),
        ("", False, False),
    ]
    assert all(c.dtype == "bf16" and c.max_lag == 0 and c.steps == 3 for c in runs)
    assert set(data["runs"]) == {"plain", "record", "replay", "dense"} and positive(
        data["runs"]["plain"]["train_s"]
    )
    # measured here, in this process: real figures even at the smoke size
    for shape in data["costs"].values():
        assert positive(shape["bytes_per_token"], shape["queue_ratio"], shape["collate_ratio"])
    assert (
        data["costs"]["tiny"]["bytes_per_token"] == 4
        and data["costs"]["30B-A3B"]["bytes_per_token"] == 384
    )


def test_gpu_trainer_runs_its_gpu_measurement_on_the_cpu(tmp_path):
    """`python bench/gpu_trainer.py --device cpu --smoke`: each shape's promised fields, rates that
    are its steps' rates, the ratio of the two, a phase breakdown, padding only where lengths were
    drawn, and no vLLM imported; asked for a GPU where there is none, it stops at once (exit 2)."""
    script = [sys.executable, str(REPO / "bench" / "gpu_trainer.py")]
    proc = subprocess.run(
        [*script, "--device", "cpu", "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "gpu_trainer.json").read_text())
    assert list(data["shapes"]) == ["tiny", "tiny-longtail"] and data["errors"] == {}
    assert data["vllm_imported"] is False
    for shape in data["shapes"].values():
        assert positive(
            shape["project_tokens_per_s"],
            shape["plain_tokens_per_s"],
            shape["project_peak_gib"],
            shape["plain_peak_gib"],
            shape["publish_over_copy"],
        )
        assert shape["project_over_plain"] == pytest.approx(
            shape["project_tokens_per_s"] / shape["plain_tokens_per_s"]
        )
        for mode in ("project", "plain"):
            run = shape[mode]
            assert len(run["step_s"]) == 2 and shape[f"{mode}_tokens_per_s"] == pytest.approx(
                shape["tokens_per_step"] / run["median_s"]
            )
            phases = run["phases_ms"]
            assert positive(*(phases[p] for p in ("forward", "head", "backward", "optimizer")))
            # the phases are the step's time, split (the marks start and end with it)
            assert sum(phases.values()) <= 1e3 * max(run["step_s"]) * 1.01
    fixed, tail = data["shapes"]["tiny"], data["shapes"]["tiny-longtail"]
    budget = tail["rows"] * (tail["seq"] - tail["prompt"])
    assert fixed["completion_tokens_per_step"] == fixed["rows"] * (fixed["seq"] - fixed["prompt"])
    assert 0 < tail["completion_tokens_per_step"] < budget
    assert fixed["project_pad_frac"] == fixed["plain_pad_frac"] == 0
    assert 0 < tail["plain_pad_frac"] < 1 and 0 <= tail["project_pad_frac"] < 1
    import torch

    if not torch.cuda.is_available():
        proc = subprocess.run([*script, "--out", str(tmp_path / "none")], capture_output=True)
        assert proc.returncode == 2 and b"no CUDA GPU visible" in proc.stderr


def test_run_all_runs_memory_at_its_smoke_size(tmp_path):
    import ab

    assert ab.main(["--what", "all", "--smoke", "--only", "memory", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "memory.json").read_text())
    assert [(r["sequences"], r["mode"]) for r in data["rows"]] == [
        (2, "micro-batched"),
        (2, "whole batch"),
    ]
    assert positive(*(r["peak_mib"] for r in data["rows"])) and positive(data["speed"][0]["ratio"])
    assert (tmp_path / "summary.md").exists()


def test_report_reads_what_the_smokes_wrote(out):
    import ab

    assert ab.main(["--what", "report", "--out", str(out)]) == 0
    text = (out / "summary.md").read_text()
    for name, heading in (
        ("overlap", "**Overlap**"),
        ("weight_sync", "**Weight sync**"),
        ("generator", "**Generator**"),
        ("trainer", "**Trainer**"),
        ("learning", "**Learning**"),
    ):
        assert ((out / f"{name}.json").exists()) == (heading in text), name
