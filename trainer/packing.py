"""trainer/packing.py — sequence packing (--packing): micro-batches that run no padding.

Role: with packing, a micro-batch's rows run through the model as one row of their real tokens,
position ids restarting at each row, no attention mask, the rows' bounds handed on as
flash-attention's varlen arguments (logprobs.final_hidden_states). A model on PyTorch's SDPA without
sliding windows then attends with `row_attention` (registered with transformers as ATTENTION): each
row causally on its own, the rows laid side by side (the flash kernel where the device has one),
which costs what the micro-batch's rows padded would, where the block-diagonal mask over N packed
tokens costs N^2. Any other model keeps each row to itself through the mask transformers 5 builds
from packed position ids (masking_utils.find_packed_sequence_indices), sliding windows included.
Nothing else changes: the loss side keeps its (B, T) tensors, routing replay takes the routes of the
packed tokens (replay.py), update.py plans micro-batches by real tokens. Here: whether a run packs
(`decide`: every model that scores tokens must keep packed rows apart; `verdict` and `problem` find
out once per model with a real forward) and the attention. train.py's start decides, so that
`--packing on` with a model that cannot pack stops the run before its first step; update.py reads
the verdicts it left (`update.packs`).
Data contract: `decide` takes the run's Config and its models (the policy, the reference, the
teacher; None where the run has none) and returns whether to pack; a model's verdict is kept on it
(ATTRIBUTE: "" where it packs, else the reason).
May touch: collectives of the default process group (`problem`: every rank runs the same forwards
and takes the largest difference, so the verdict is the same on every rank); a model's attention
implementation (its config's, SDPA to ATTENTION where that packs); transformers' attention
registries (ATTENTION, on import); stderr (one note).
"""

import sys

import torch
import torch.distributed as dist
from transformers import AttentionInterface, masking_utils
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from config import CHOICES, Config
from trainer.logprobs import final_hidden_states

ATTRIBUTE = "packing_problem"  # where `decide` leaves a model's verdict
ATTENTION = "sdpa_packed_rows"  # `row_attention`'s name in transformers' registries
# The probe's two rows: a long one, then a short one that would see it were the mask to leak; a
# leak moves the short row's last hidden states by about their own size.
PROBE_LENGTHS = (24, 6)
# The largest relative L2 difference of the short row's hidden states, packed against alone, that
# still counts as equal: float32 differs in the last bits (~1e-7), 16-bit kernels by up to ~1e-2.
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
HALF_TOLERANCE = 5e-2


def decide(cfg: Config, models, rank: int = 0, world_size: int = 1) -> bool:
    """Whether the run's micro-batches are packed: never with --packing off; otherwise only if every
    model of `models` that scores tokens (None: the run has none) keeps packed rows apart
    (`problem`, found once per model, on every rank alike). --packing on with one that cannot: an
    error line; auto: padded micro-batches, and rank 0 says why when the model is first probed."""
    if cfg.packing not in CHOICES["packing"]:
        raise ValueError(f"--packing must be one of {CHOICES['packing']} (got {cfg.packing!r})")
    if cfg.packing == "off":
        return False
    for model in models:
        if model is None:
            continue
        known = hasattr(model, ATTRIBUTE)
        if not known:
            setattr(model, ATTRIBUTE, verdict(model, world_size))
        reason = getattr(model, ATTRIBUTE)
        if not reason:
            continue
        line = f"--packing {cfg.packing}: the {model.config.model_type} model {reason}"
        if cfg.packing == "on":
            raise SystemExit(f"error: {line}; run with --packing auto or off")
        if rank == 0 and not known:
            print(f"note: {line}: micro-batches are padded", file=sys.stderr, flush=True)
        return False
    return True


def verdict(model, world_size: int = 1) -> str:
    """Why `model` cannot keep packed rows apart (`problem`), or "" where it can. A model on SDPA
    without sliding windows (`windowless`) is tried with `row_attention` first and keeps it where it
    passes; otherwise it is back on SDPA, whose mask transformers builds from the packed position
    ids (windows included), and tried again."""
    config = model.config
    if config._attn_implementation == "sdpa" and windowless(config):
        config._attn_implementation = ATTENTION
        if problem(model, world_size) is None:
            return ""
        config._attn_implementation = "sdpa"
    return problem(model, world_size) or ""


def windowless(config) -> bool:
    """Whether no layer of the model attends through a sliding window (`row_attention` attends
    causally over whole rows): every layer type full attention, or without layer types no window
    or one switched off."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return all(kind == "full_attention" for kind in types)
    return not getattr(config, "sliding_window", None) or not getattr(
        config, "use_sliding_window", True
    )


def row_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """Transformers' SDPA attention (integrations/sdpa_attention.py), each packed row on its own: a
    packed forward's (1, heads, N, head_dim) query, key and value, whose rows' bounds come as
    cu_seq_lens_q and max_length_q (logprobs.final_hidden_states), are laid out as (rows, heads,
    longest, head_dim), right-padded, and attend causally without a mask (a real token never sees
    the padding after it, so each row's outputs are its own); the packed outputs are taken back.
    Anything else (a padded forward, a model that does not hand the bounds on) goes to SDPA as it
    is, with the mask `row_mask` built."""
    bounds, longest = kwargs.pop("cu_seq_lens_q", None), kwargs.pop("max_length_q", None)
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if window and bounds is not None and attention_mask is None:
        # (`verdict` puts only models without windows on this attention)
        raise RuntimeError("row_attention: a sliding-window layer in a packed forward, unmasked")
    if bounds is None or longest is None or query.shape[0] != 1 or window:
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    starts, lengths = bounds[:-1].long(), bounds.diff().long()
    offsets = torch.arange(longest, device=query.device)
    real = offsets[None, :] < lengths[:, None]
    # (padding takes the last token: it is never attended to, and its outputs are dropped)
    index = torch.where(real, starts[:, None] + offsets[None, :], query.shape[2] - 1)

    def by_rows(x):  # (1, heads, N, head_dim) -> (rows, heads, longest, head_dim)
        return x[0][:, index].transpose(0, 1)

    out, weights = sdpa_attention_forward(
        module, by_rows(query), by_rows(key), by_rows(value), None, *args, **kwargs
    )
    return out[real][None], weights  # (1, N, heads, head_dim), as SDPA returns


def row_mask(*args, attention_mask=None, **kwargs):
    """The mask `row_attention` gets: SDPA's (masking_utils.sdpa_mask), but none for a forward
    without an attention mask (a packed one, or one of unpadded rows, which SDPA attends causally
    without a mask too): row_attention keeps packed rows apart itself, so the packed tokens' N x N
    mask is never built. (A model that did not hand it the rows' bounds would attend across rows:
    `problem` finds that, and the model stays on SDPA.)"""
    if attention_mask is None:
        return None
    return masking_utils.sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(ATTENTION, row_attention)
masking_utils.AttentionMaskInterface.register(ATTENTION, row_mask)


def static_problem() -> str | None:
    """Why no model can pack here, read without a model (prepare.prepare_run refuses --packing on
    with it before anything starts); None if models may."""
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        return "cannot pack: this transformers builds no masks of packed rows (transformers 5 does)"
    return None


def problem(model, world_size: int = 1) -> str | None:
    """Why `model` cannot keep packed rows apart, in a few words; None if it can. A real probe: two
    rows (PROBE_LENGTHS) run packed and each alone, a forward each without gradients; the short
    row's last hidden states must agree (TOLERANCE, by the dtype the model computes in). Under
    FSDP2 every rank runs it (the forwards gather shards) and the largest difference decides."""
    found = static_problem()
    if found:
        return found
    weight = model.get_output_embeddings().weight
    generator = torch.Generator().manual_seed(0)
    rows = [
        torch.randint(0, model.config.vocab_size, (n,), generator=generator) for n in PROBE_LENGTHS
    ]
    ids = torch.zeros(len(rows), max(PROBE_LENGTHS), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], attention[i, : len(row)] = row, 1
    ids, attention, short = ids.to(weight.device), attention.to(weight.device), rows[-1]
    decoder = model.get_decoder()
    with torch.no_grad():
        packed = final_hidden_states(model, decoder, ids, attention, packed=True)[0, -len(short) :]
        alone = final_hidden_states(
            model, decoder, ids[-1:, : len(short)], attention[-1:, : len(short)]
        )
    alone = alone[0].float()
    difference = ((packed.float() - alone).norm() / alone.norm().clamp(min=1e-30)).reshape(1)
    if world_size > 1:
        dist.all_reduce(difference, op=dist.ReduceOp.MAX)
    tolerance = TOLERANCE.get(packed.dtype, HALF_TOLERANCE)
    if not float(difference) <= tolerance:
        return (
            f"does not keep packed rows apart (a row packed after another differs from it alone "
            f"by {float(difference):.2g} relative, more than {tolerance:g}: its attention mask "
            "ignores the position ids)"
        )
    return None
