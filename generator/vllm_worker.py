"""generator/vllm_worker.py — the generator's side of the weight sync: a vLLM worker extension
reading the packed buffer.

Role: `WeightSyncWorker` is mixed into vLLM's worker
(`worker_extension_cls="generator.vllm_worker.WeightSyncWorker"`) and reloads the engine's weights,
or with --lora-rank its adapter, from the packed buffer (shared_weights.py) between engine steps,
called through `collective_rpc` (arguments are bytes).
Data contract: the buffer's `Slot`s are named and shaped as the trainer's (transformers 5)
parameters, or PEFT's adapter files; each slot is handed to vLLM as the checkpoint tensors it stands
for (transformers' reverse weight conversion: a fused 3-D MoE expert tensor becomes the per-expert
tensors vLLM's loader expects, as `save_pretrained` writes them). A load returns the version it
loaded, never a torn mix.
May touch: the vLLM worker it is installed into (private vLLM 0.32 APIs: the layer-wise reload, the
MoE layers' kernels, the LoRA manager), and its logger's filters.
"""

from __future__ import annotations

import logging

import torch

from generator.routes import RouteRecorder
from generator.shared_weights import SharedWeights
from infra import tracing

VIEW_TRIES = 3  # torn in-place reloads before the worker falls back to a snapshot copy (CPU)
# torn in-place reloads before a GPU worker gives up (it has no snapshot to fall back to)
GPU_VIEW_TRIES = 20
GPU_MIN_WAIT_S = 120.0  # the least a GPU worker waits for a publish (a gather over NCCL) to finish
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"  # vLLM 0.32's layer-wise reload
# its summary of weights not loaded
INPLACE_LOGGER = "vllm.model_executor.model_loader.reload.inplace"


class ExpectedReloadWarnings(logging.Filter):
    """Drops the two "X: Failed to load weights" warnings vLLM's layer-wise reload logs at every
    sync, both expected: a rotary embedding has no weights to load (its cos/sin cache is computed),
    and with tied embeddings the buffer holds the embedding once, so the LM head gets nothing
    (`_refresh_tied_lm_head` re-ties it after each load). The same warning for any other layer is a
    real failure and still shows."""

    def __init__(self, tied_embeddings: bool):
        super().__init__()
        self.tied_embeddings = tied_embeddings

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights" or not record.args:
            return True
        layer = str(record.args[0])
        expected = layer.endswith("RotaryEmbedding") or (
            self.tied_embeddings and layer == "ParallelLMHead"
        )
        return not expected


def checkpoint_skeleton(hf_config):
    """The trainer's model (transformers 5) on the meta device: what names the reverse weight
    conversion. None for a config that is not transformers' (a stand-in worker's): its slots pass
    under their own names."""
    from transformers import AutoModelForCausalLM, PretrainedConfig

    if not isinstance(hf_config, PretrainedConfig):
        return None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def compile_off_vllm_config(vllm_config):
    """`vllm_config` (the worker's) as the current vLLM config, with compilation off, for building a
    transformers model inside vLLM's worker: vLLM's Transformers backend (how it serves OLMo-2)
    decorates transformers' own decoder class in that process for its torch.compile, and the
    decorated class then reads vLLM's current config when it is built (without one
    `checkpoint_skeleton` failed, and every OLMo-2 run died at its start). Compilation off: the
    skeleton is a plain model, as in the trainer; the engine's own config is left as it is. (No
    config, as in a test's stand-in worker: nothing to set.)"""
    import contextlib
    import copy

    if vllm_config is None:
        return contextlib.nullcontext()

    from vllm.config import set_current_vllm_config
    from vllm.config.compilation import CompilationMode

    config = copy.copy(vllm_config)
    config.compilation_config = copy.copy(vllm_config.compilation_config)
    config.compilation_config.mode = CompilationMode.NONE
    return set_current_vllm_config(config)


def checkpoint_tensors(skeleton, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One trainer parameter as the checkpoint's tensors vLLM's `load_weights` expects:
    transformers' reverse weight conversion (what `save_pretrained` writes). Most families' dense
    weights pass as they are; a fused MoE expert tensor (`mlp.experts.gate_up_proj`, experts x 2
    intermediate x hidden) becomes one tensor per expert and projection
    (`mlp.experts.0.gate_proj.weight`, or Mixtral's `block_sparse_moe.experts.0.w1.weight`): views
    of `tensor` where they can be, else copies of one parameter at a time."""
    from transformers.core_model_loading import revert_weight_conversion

    if skeleton is None:
        return [(name, tensor)]
    return list(revert_weight_conversion(skeleton, {name: tensor}).items())


def drop_moe_kernels(model) -> list:
    """Make the coming reload rebuild every MoE layer's kernel. vLLM 0.32 builds it once, at the
    first load, and runs the kernel's own post-load step only then: on CPU that step packs the
    expert weights into the grouped-GEMM layout the kernel reads (fused_moe/experts/cpu_moe.py). A
    reload that finds a kernel copies the new weights in unpacked, and the engine samples from
    weights read in the wrong layout (a tiny Qwen3-MoE: 0.019 off the trainer's log-probs after one
    publish). With no kernel, the reload's processing builds and packs it as at start; the
    layer-wise reload then copies the packed weights into the engine's own storage. Only kernels
    with a post-load step of their own are dropped (the others, most GPU kernels, take the new
    weights as they are). Returns (layer class, its quant method) for each kernel dropped."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    dropped = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        post_load = getattr(type(experts), "process_weights_after_loading", None)
        if experts is not None and post_load is not FusedMoEExperts.process_weights_after_loading:
            method.moe_kernel = None
            dropped.append((type(module).__name__, method))
    return dropped


class ExpectedUnloadedWeights(logging.Filter):
    """Drops vLLM's "Following weights were not loaded" warning when the only weights a sync leaves
    out are MoE routers' score-correction biases (GLM-4-MoE, DeepSeek-V3 style): buffers in
    transformers, never trained, so vLLM's copy from the start is still the trainer's. Any other
    weight left out still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Following weights were not loaded") or not record.args:
            return True
        return not all(str(name).endswith("e_score_correction_bias") for name in record.args[0])


class WeightSyncWorker(RouteRecorder):
    """vLLM worker extension (`worker_extension_cls="generator.vllm_worker.WeightSyncWorker"`).

    Mixed into vLLM's worker class, so `self` is the worker: `self.model_runner.reload_weights` does
    the layer-wise reload (and on CPU, the re-packing of linear weights for its kernels) correctly,
    where a plain `model.load_weights` fails. Called through `collective_rpc`; arguments are bytes.
    """

    def attach_shared_weights(self, handles: bytes) -> int:
        self._shared = SharedWeights.from_bytes(handles)
        with compile_off_vllm_config(getattr(self, "vllm_config", None)):
            self._skeleton = checkpoint_skeleton(self.model_runner.model_config.hf_config)
        tied = getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False)
        logging.getLogger(RELOAD_LOGGER).addFilter(ExpectedReloadWarnings(tied))
        logging.getLogger(INPLACE_LOGGER).addFilter(ExpectedUnloadedWeights())
        # vLLM 0.32's OLMoE, GLM-4-MoE and AFMoE never tie their LM head to the embedding: with tied
        # embeddings (no lm_head.weight in the checkpoint) they sampled from an LM head vLLM never
        # loaded (NaN, or 0.8-3.4 nats off the trainer's log-probs at start). Tie it before the
        # first request, as every load does after a sync (a head vLLM tied itself is left as it is).
        self._refresh_tied_lm_head(untied_only=True)
        # On a GPU worker `.buffer` opens the CUDA IPC handle here, once (on the buffer's own GPU,
        # which must be visible to this process). No snapshot on a GPU: vLLM has already sized its
        # KV cache to fill its share. On CPU a snapshot is allocated only if an in-place load ever
        # has to fall back to it.
        self._snapshot = None
        tracing.watch_engine(self)  # (with OUT/trace: each engine step, from now on)
        return self._shared.buffer.numel()

    def flush_trace(self) -> None:
        """Write this worker's trace events now (the generator asks before the engine shuts
        down)."""
        tracing.flush()

    def _load_device(self) -> torch.device:
        try:
            return torch.device(self.device)  # a GPU worker's own GPU
        except AttributeError:
            return torch.device("cpu")

    @tracing.timed("load weights", track="weight loads", step_from_result=True)
    def load_shared_weights(self, min_version: int = -1) -> int:
        """Reload the newest consistent weights into the engine; returns the version loaded.

        Straight from views of the shared buffer, with no private copy of it. `reload_weights`
        copies every tensor into the engine's own parameters (the same storage: CUDA graphs stay
        valid; on CPU re-packed for its kernels), so the engine never aliases the buffer. The
        seqlock guards the reload: if the trainer wrote meanwhile, the engine holds a torn mix, and
        we reload again. Generation is paused during the whole load, so a torn state is never
        sampled from. CPU: after `VIEW_TRIES` torn reloads (a writer publishing faster than we
        reload) we fall back to a snapshot copy. GPU: the copies run device to device (peer to peer
        when the buffer is on another GPU, one tensor in flight at a time); a publish there gathers
        every parameter over NCCL while `seq` is odd, so the load waits longer, and never allocates
        a full-size snapshot.
        """
        shared = self._shared
        if shared.device_type == "cuda":
            wait_s = shared.writer_wait_s(GPU_MIN_WAIT_S)
            version = shared.read_in_place(
                self._reload_from, max_tries=GPU_VIEW_TRIES, max_wait_s=wait_s
            )
            if version is None:
                raise RuntimeError(
                    f"load_shared_weights: no untorn reload in {GPU_VIEW_TRIES} tries within "
                    f"{wait_s:.0f} s (is the trainer publishing back to back?)"
                )
        else:
            version = shared.read_in_place(self._reload_from, max_tries=VIEW_TRIES)
            if version is None:
                if self._snapshot is None:
                    self._snapshot = torch.empty_like(shared.buffer)
                version = shared.read_snapshot(self._snapshot)
                self._reload_from(self._snapshot)
        if version < min_version:
            raise RuntimeError(
                f"load_shared_weights: buffer holds version {version} < wanted {min_version}"
            )
        self._refresh_tied_lm_head()
        return version

    def _reload_from(self, buffer: torch.Tensor) -> None:
        """vLLM's layer-wise reload from views of `buffer` (the shared buffer itself, or our
        snapshot). A view on another GPU than the worker's is moved over one tensor at a time, as
        the loader asks for it."""
        shared, device = self._shared, self._load_device()

        def weights():
            for slot in shared.layout:
                for name, view in checkpoint_tensors(
                    self._skeleton, slot.name, shared.view(slot, buffer)
                ):
                    yield (
                        name,
                        view if view.device == device else view.to(device, non_blocking=True),
                    )

        dropped = drop_moe_kernels(self.model_runner.get_model())
        self.model_runner.reload_weights(weights_iterator=weights())
        unloaded = sorted({name for name, method in dropped if method.moe_kernel is None})
        # the reload never processed these layers: their expert weights were not loaded
        if unloaded:
            raise RuntimeError(
                f"vLLM's reload loaded no expert weights into {', '.join(unloaded)} (its loader "
                "copies them past the layer-wise reload): this MoE family cannot take weight syncs"
            )

    def _refresh_tied_lm_head(self, untied_only: bool = False) -> None:
        """With tied embeddings the checkpoint has no `lm_head.weight`, so the layer-wise reload
        never re-processes `lm_head`: on CPU its kernel keeps a packed copy of the *old* embedding
        (logprobs then drift from the trainer's). Re-tie and re-pack it. `untied_only`: only where
        vLLM's model class did not tie it (at start)."""
        model = self.model_runner.get_model()
        lm_head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
        embed = getattr(inner, "embed_tokens", None)
        config = self.model_runner.model_config.hf_config
        if lm_head is None or embed is None or not getattr(config, "tie_word_embeddings", False):
            return
        tied = lm_head is embed or lm_head.weight is embed.weight
        if tied and untied_only:
            return
        if not tied:
            lm_head.weight = embed.weight
        method = getattr(lm_head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(lm_head)

    @tracing.timed("load adapter", track="weight loads", step_from_result=True)
    def load_shared_adapter(self, min_version: int, adapter_dir: str, lora_id: int) -> int:
        """LoRA (`--lora-rank`): the buffer holds only the adapter. Copy a consistent snapshot of it
        and make it the engine's adapter `lora_id` in place of the previous one (requests keep their
        LoRARequest). `adapter_dir` holds the adapter's `adapter_config.json` (rank, alpha). Returns
        the version loaded."""
        # vLLM in its worker process only (the trainer imports this file)
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        shared = self._shared
        # small: a private CPU copy, as vLLM loads adapters
        if getattr(self, "_adapter_snapshot", None) is None:
            self._adapter_snapshot = torch.empty(shared.buffer.shape, dtype=shared.buffer.dtype)
        version = shared.read_snapshot(
            self._adapter_snapshot, max_tries=1000 if shared.device_type == "cpu" else 100_000
        )
        if version < min_version:
            raise RuntimeError(
                f"load_shared_adapter: buffer holds version {version} < wanted {min_version}"
            )
        workers = self.model_runner.lora_manager  # vLLM's LRUCacheWorkerLoRAManager
        manager = workers._adapter_manager
        helper = PEFTHelper.from_local_dir(adapter_dir, workers.max_position_embeddings)
        helper.validate_legal(workers.lora_config)
        # vLLM folds the scaling into lora_b in place when
        # it packs q/k/v: hand it copies, not our snapshot.
        tensors = {
            slot.name: shared.view(slot, self._adapter_snapshot).clone() for slot in shared.layout
        }
        mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
        adapter = LoRAModel.from_lora_tensors(
            lora_model_id=lora_id,
            tensors=tensors,
            peft_helper=helper,
            device="cpu",
            dtype=workers.lora_config.lora_dtype,
            model_vocab_size=workers.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(manager.model, "lora_skip_prefixes", None),
        )
        manager.remove_adapter(lora_id)
        manager.add_adapter(adapter)  # packs q/k/v (and gate/up) into vLLM's fused modules
        unknown = [name for name in adapter.loras if name not in manager.modules]
        # an adapter that silently never reaches the engine is the classic bug
        if not adapter.loras or unknown:
            raise RuntimeError(
                f"the adapter's modules {unknown or '(none)'} are not LoRA modules of vLLM's "
                f"model (those are e.g. {sorted(manager.modules)[:4]})"
            )
        manager.activate_adapter(lora_id)  # copies A and B into the engine's stacked LoRA buffers
        return version
