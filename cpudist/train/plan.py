"""Will it fit: the memory a run needs per rank and per node, predicted before any weight is read.

The model's parameters are counted on a meta-device copy built from config.json (no memory). Per
rank: the adapter (fp32 weights, gradients, AdamW moments), activations
kept for backward (all layers, or with activation checkpointing each layer's input plus one
layer recomputed), the chunked loss head's buffers, the dequantization buffers of a quantized base
(one decoder layer's weights) and the process itself. Per node: the frozen weights once (mapped
and shared by the node's ranks; an untied embedding counts only for the rows a step touches) plus
every rank's own memory.

The activation figures are bytes per token per layer, fitted to peaks measured with the bench on
the development machine (docs/PERFORMANCE.md: "Will it fit"), so they describe PyTorch 2.13's
SDPA attention and transformers 5's Llama/Qwen2/Mistral layers; `plan` says so where it prints them.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cpudist.config import Config
from cpudist.errors import PlanRefused, UserError

log = logging.getLogger("cpudist")
GB = 1024**3

# Fitted on the bench's peaks (see the module docstring): bytes kept per token, per layer, per
# unit of hidden size (h) and of MLP width (i), in bf16 and in fp32 compute.
ACTIVATION_BYTES = {"bfloat16": (26.0, 8.0), "float32": (34.0, 16.0)}
EAGER_SCORE_BYTES = 8  # kept per attention score and layer by eager attention (see estimate)
# With checkpointing each layer keeps its input (h values); one layer is recomputed at a time.
CHECKPOINT_KEPT = {"bfloat16": 2.0, "float32": 4.0}
PROCESS_GB = 0.75  # python, torch, transformers, tokenizer, allocator slack
HEADROOM = 0.95  # a plan fits when the node's peak is at most this share of its memory


@dataclass(frozen=True)
class Parts:
    """Parameter counts of a model, by what the plan does with them."""

    linears: int  # decoder linear weights (what model.quantize stores quantized)
    linear_shapes: tuple[tuple[int, int], ...]  # (out, in) of each, for scratch and LoRA sizes
    embedding: int
    head: int  # 0 when tied to the embedding
    other: int  # norms, biases
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    tied: bool
    heads: int = 0
    eager_attention: bool = False  # attention scores materialized (model.attn_implementation)


@dataclass
class MemoryPlan:
    ranks_per_node: int
    node_memory_gb: float
    node_memory_from: str
    frozen_gb: dict[str, float]  # shared per node when mapped
    frozen_shared: bool
    rank_gb: dict[str, float]  # each rank's own
    node_peak_gb: float = 0.0
    rank_peak_gb: float = 0.0
    fits: bool = True
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def model_parts(config: Config) -> Parts:
    """Parameter counts from the model directory's config.json, on the meta device."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from cpudist.model.gguf_import import gguf_cache_dir, gguf_config
    from cpudist.model.load import attention_implementation, resolve_model_path

    path = Path(config.model.path).expanduser()
    cache = Path(config.model.cache_dir).expanduser()
    try:
        if (path.suffix == ".gguf" and path.is_file()
                and not (gguf_cache_dir(path, cache) / "config.json").is_file()):
            # The config alone, from the file's metadata: converting a 9B file first would take
            # minutes and its size in bf16 on disk, before the plan says whether it fits.
            hf_config = gguf_config(path)
        else:
            path = resolve_model_path(config.model)
            hf_config = AutoConfig.from_pretrained(path, trust_remote_code=config.model.trust_remote_code)
        with init_empty_weights(include_buffers=True):
            model = AutoModelForCausalLM.from_config(
                hf_config, trust_remote_code=config.model.trust_remote_code)
    except (ValueError, KeyError) as exc:
        message = str(exc).splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{path}: not loadable as a causal language model ({message}); give a "
                        "Hugging Face causal LM directory (Llama, Qwen2, Mistral, ...)") from exc
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    tied = head is not None and head.weight is embedding.weight
    shapes = tuple(tuple(m.weight.shape) for m in model.modules()
                   if isinstance(m, torch.nn.Linear) and m is not head)
    linears = sum(out * in_ for out, in_ in shapes)
    total = sum(p.numel() for p in model.parameters())
    n_embed = embedding.weight.numel()
    n_head = 0 if tied else head.weight.numel()
    eager = attention_implementation(config.model.attn_implementation, hf_config) == "eager"
    hf_config = hf_config.get_text_config()  # a multimodal model's (Gemma 3 4B+) text model
    return Parts(linears=linears, linear_shapes=shapes, embedding=n_embed, head=n_head,
                 other=total - linears - n_embed - n_head, hidden=hf_config.hidden_size,
                 intermediate=getattr(hf_config, "intermediate_size", 4 * hf_config.hidden_size),
                 layers=hf_config.num_hidden_layers, vocab=hf_config.vocab_size, tied=tied,
                 heads=hf_config.num_attention_heads, eager_attention=eager)


def trainable_params(parts: Parts, config: Config) -> int:
    """The parameters peft.method trains (the classification head aside: a few thousand)."""
    method, h = config.peft.method, parts.hidden
    if method == "full":
        return total_params(parts)
    if method == "lora":
        targets = config.lora.target_modules
        shapes = parts.linear_shapes
        if targets != "all-linear":
            # A list names leaf modules; without the names here, count the share of linears the
            # usual attention-only lists cover (q, k, v, o: 4 of the 7 linears of a layer).
            shapes = shapes[: max(1, len(shapes) * len(targets) // 7)]
        return sum(config.lora.r * (out + in_) for out, in_ in shapes)
    if method == "ia3":  # a vector per scaled module: keys, values and the MLP's input
        return parts.layers * (2 * h + parts.intermediate)
    virtual = config.prompt.virtual_tokens
    if method == "prompt_tuning":
        return virtual * h
    if method == "p_tuning":
        e = config.prompt.encoder_hidden_size
        return virtual * h + h * e + e * e + e * h
    return virtual * 2 * h * parts.layers  # prefix_tuning: keys and values in every layer


def total_params(parts: Parts) -> int:
    return parts.linears + parts.embedding + parts.head + parts.other


def full_training_gb(config: Config, parts: Parts, ranks_per_node: int, compute: str,
                     world_size: int) -> dict[str, float]:
    """peft.method=full, each rank's own: fp32 master weights, their gradients, AdamW's two fp32
    moments (with train.zero a 1/ranks share: at least the node's ranks share the state) and,
    under bf16 autocast on several ranks, the bf16 copy of every linear's weight that forward
    casts and backward keeps. DDP's buckets hold the gradients themselves
    (gradient_as_bucket_view), no second copy, and they are there all along, beside the copies.
    One rank has no buckets: backward (outside autocast) frees each layer's copies as it makes
    that layer's gradients, at twice their bytes, so the copies never add to the gradients."""
    total = total_params(parts)
    shards = ranks_per_node if config.train.zero and ranks_per_node > 1 else 1
    rank = {"weights (fp32)": total * 4 / GB, "gradients (fp32)": total * 4 / GB,
            "AdamW moments" + (f" (1/{shards}, train.zero)" if shards > 1 else ""):
                total * 8 / shards / GB}
    if compute == "bfloat16" and world_size > 1:
        # A tied head is the embedding's weight: autocast casts (and caches) it for the head's
        # matmul like any linear's, though the lookup itself reads the fp32 rows.
        head = parts.embedding if parts.tied else parts.head
        rank["bf16 weight copies (autocast)"] = (parts.linears + head) * 2 / GB
    return rank


def trainable_head_loss_gb(config: Config, parts: Parts, tokens: int, bytes_per: int) -> float:
    """The loss head when it trains (peft.method=full): cpudist.model.loss keeps every label
    row's logit gradient in the compute dtype for the head's weight gradient (tokens x vocab x
    bytes_per), and makes that fp32 gradient (vocab x hidden x 4; from bf16 a block of rows at a
    time) at the start of backward, where every activation is still held."""
    from cpudist.model.loss import padded_rows

    rows = padded_rows(tokens)  # the label rows, padded as the head pads them
    weight_grad = parts.vocab * parts.hidden * 4
    return (rows * parts.vocab * bytes_per + weight_grad) / GB


def _tokens(config: Config) -> int:
    """Positions a micro-batch computes: prompt tuning and P-tuning add their virtual tokens."""
    extra = config.prompt.virtual_tokens if config.peft.method in ("prompt_tuning", "p_tuning") else 0
    return rows_per_micro_batch(config) * (config.data.max_length + extra)


def estimate(config: Config, parts: Parts, ranks_per_node: int, node_memory: tuple[float, str],
             compute: str, world_size: int | None = None) -> MemoryPlan:
    """The plan for config on a node of node_memory (GB, where the figure comes from), in a run
    of world_size ranks (default: the node's)."""
    full = config.peft.method == "full"
    frozen = {} if full else frozen_gb(config, parts, compute)
    rank = rank_gb(config, parts, ranks_per_node, compute, world_size or ranks_per_node)
    shared = not full and (config.model.share_frozen_weights or config.model.quantize != "none")
    node_memory_gb, source = node_memory
    plan = MemoryPlan(ranks_per_node, node_memory_gb, source, frozen, shared, rank)
    frozen_total = sum(frozen.values())
    rank_total = sum(rank.values())
    plan.rank_peak_gb = rank_total + (frozen_total if not shared else frozen_total / ranks_per_node)
    plan.node_peak_gb = (frozen_total * (1 if shared else ranks_per_node)
                         + rank_total * ranks_per_node)
    plan.fits = plan.node_peak_gb <= HEADROOM * node_memory_gb
    plan.notes.append("activation figures fitted to bench peaks of PyTorch 2.13 / transformers 5 "
                      "(docs/PERFORMANCE.md, \"Will it fit\")")
    return plan


def frozen_gb(config: Config, parts: Parts, compute: str) -> dict[str, float]:
    """The frozen weights' GB by part: stored in the compute dtype, or as the quantization method
    lays them out; an untied embedding only for the rows a step reads."""
    bytes_per = 2 if compute == "bfloat16" else 4
    quantize = config.model.quantize
    frozen: dict[str, float] = {}
    if quantize == "none":
        frozen["decoder linears"] = parts.linears * bytes_per / GB
    else:  # the bytes the method stores for each linear (codes, scales, zeros)
        import torch

        from cpudist.model.quantize import METHODS

        dtype = torch.bfloat16 if compute == "bfloat16" else torch.float32
        stored = sum(torch.Size(shape).numel() * torch.empty((), dtype=kind).element_size()
                     for out, in_ in parts.linear_shapes
                     for shape, kind in METHODS[quantize].layout(
                         out, in_, config.model.quantize_group, dtype).values())
        frozen[f"decoder linears ({quantize})"] = stored / GB
    if parts.tied:
        frozen["embedding + tied LM head"] = parts.embedding * bytes_per / GB
    else:
        # A lookup touches only the pages of the rows it reads.
        tokens = rows_per_micro_batch(config) * config.data.max_length
        rows = min(parts.vocab, tokens * config.train.grad_accum)
        frozen["embedding (rows read)"] = min(parts.embedding, rows * parts.hidden) * bytes_per / GB
        if quantized_head(config, parts):  # int8 codes and a scale per vocabulary row
            frozen["LM head (int8)"] = (parts.head + parts.vocab * bytes_per) / GB
        else:
            frozen["LM head"] = parts.head * bytes_per / GB
    frozen["norms, biases"] = parts.other * bytes_per / GB
    return frozen


def quantized_head(config: Config, parts: Parts) -> bool:
    """Whether the LM head is stored quantized (cpudist.model.quantize.QuantizedHead)."""
    return config.model.quantize != "none" and config.model.quantize_head and not parts.tied


def rows_per_micro_batch(config: Config) -> int:
    """Sequences of a micro-batch: train.batch_size samples, each of the objective's sequences
    (a preference pair puts its chosen and its rejected answer through the model together)."""
    from cpudist.objectives import OBJECTIVES, objective_name

    return config.train.batch_size * OBJECTIVES[objective_name(config)].sequences_per_sample


def rank_gb(config: Config, parts: Parts, ranks_per_node: int, compute: str,
            world_size: int) -> dict[str, float]:
    """Each rank's own GB by part: the adapter and its optimizer state, activations, the loss
    head's buffers, the dequantization buffers, the process."""
    bytes_per = 2 if compute == "bfloat16" else 4
    sequences = rows_per_micro_batch(config)
    tokens = _tokens(config)
    rank: dict[str, float] = {}
    if config.peft.method == "full":
        rank.update(full_training_gb(config, parts, ranks_per_node, compute, world_size))
    else:
        rank["adapter, gradients, AdamW"] = trainable_params(parts, config) * 16 / GB
    per_h, per_i = ACTIVATION_BYTES[compute]
    per_layer_token = per_h * parts.hidden + per_i * parts.intermediate
    if config.model.gradient_checkpointing:
        kept = CHECKPOINT_KEPT[compute] * parts.hidden * tokens * parts.layers
        rank["activations (checkpointed)"] = (kept + per_layer_token * tokens) / GB
    else:
        rank["activations"] = per_layer_token * tokens * parts.layers / GB
    if parts.eager_attention:
        # Eager attention saves 8 bytes per score (batch x heads x length^2) and layer for
        # backward (measured on Gemma 2, bf16 and fp32), and the layer being computed as much
        # again in transient buffers; sdpa keeps no score matrix.
        scores = sequences * parts.heads * config.data.max_length ** 2
        holding = 1 if config.model.gradient_checkpointing else parts.layers
        rank["attention scores (eager)"] = EAGER_SCORE_BYTES * scores * (holding + 1) / GB
    chunk = config.train.loss_chunk_size
    if chunk and config.peft.method == "full":
        rank["loss head (trains)"] = trainable_head_loss_gb(
            config, parts, tokens, bytes_per)
    elif chunk:
        rows = min(chunk, tokens)
        # The chunk's logits in the compute dtype, plus (bf16) the few rows whose softmax is
        # taken in fp32 at a time (cpudist.model.loss.softmax_rows; 64 covers 32 threads).
        fp32_rows = 0 if bytes_per == 4 else min(rows, 64)
        rank["loss head chunk"] = (rows * bytes_per + fp32_rows * 4) * parts.vocab / GB
    else:
        rank["full logits"] = tokens * parts.vocab * 4 * 3 / GB
    if config.model.quantize != "none":
        # A scratch slot per linear of a decoder layer (one layer's weights in the compute
        # dtype, cpudist.model.quantize._Scratch), plus the eager int4 unpack's codes.
        largest = max(out * in_ for out, in_ in parts.linear_shapes)
        one_layer = max(largest, parts.linears / max(parts.layers, 1))
        rank["dequantization buffers"] = (one_layer * bytes_per + largest) / GB
        if quantized_head(config, parts):  # one block of the head's rows at a time
            from cpudist.model.quantize import HEAD_BLOCK_ROWS

            block = min(HEAD_BLOCK_ROWS, parts.vocab) * parts.hidden * bytes_per
            rank["dequantization buffers"] += block / GB
    rank["process"] = PROCESS_GB
    return rank


def advise(config: Config, parts: Parts, ranks_per_node: int, node_memory: tuple[float, str],
           compute: str, world_size: int | None = None) -> list[str]:
    """Settings that would make a plan that does not fit fit, smallest change first."""
    tries: list[tuple[str, list[str]]] = []
    if not config.model.gradient_checkpointing:
        tries.append(("model.gradient_checkpointing=true", ["model.gradient_checkpointing=true"]))
    if config.peft.method == "full" and ranks_per_node > 1 and not config.train.zero:
        tries.append(("train.zero=true", ["train.zero=true"]))
    for method in ("int8", "int4"):
        if config.peft.method == "full":
            break  # a quantized base cannot train in full
        if config.model.quantize in ("none", "int8") and config.model.quantize != method:
            tries.append((f"model.quantize={method}", [f"model.quantize={method}"]))
    batch = config.train.batch_size
    while batch > 1:
        batch //= 2
        accum = config.train.grad_accum * config.train.batch_size // batch
        tries.append((f"train.batch_size={batch} train.grad_accum={accum} (same global batch)",
                      [f"train.batch_size={batch}", f"train.grad_accum={accum}"]))
    if ranks_per_node > 1:
        tries.append((f"{ranks_per_node // 2} ranks per node", []))
    advice = []
    for label, overrides in tries:
        changed = _with(config, overrides)
        ranks = ranks_per_node // 2 if not overrides else ranks_per_node
        if estimate(changed, parts, max(1, ranks), node_memory, compute, world_size).fits:
            advice.append(label)
        # Combine with checkpointing: most big runs need both.
        elif overrides and overrides[0] != "model.gradient_checkpointing=true" and \
                not config.model.gradient_checkpointing:
            both = _with(changed, ["model.gradient_checkpointing=true"])
            if estimate(both, parts, ranks, node_memory, compute, world_size).fits:
                advice.append(f"model.gradient_checkpointing=true {label}")
        if len(advice) == 3:
            break
    return advice


def _with(config: Config, overrides: list[str]) -> Config:
    from cpudist.config import parse_override

    changes = {}
    for item in overrides:
        (section, key), value = parse_override(item)
        changes[section, key] = value
    return config.with_settings(changes)


def make_plan(config: Config, ranks_per_node: int, world_size: int | None = None) -> MemoryPlan:
    from cpudist.runtime.memory import node_memory_gb
    from cpudist.runtime.precision import choose_precision

    parts = model_parts(config)
    compute = choose_precision(config.model.dtype).compute
    node = node_memory_gb()
    plan = estimate(config, parts, ranks_per_node, node, compute, world_size)
    if not plan.fits:
        plan.advice = advise(config, parts, ranks_per_node, node, compute, world_size)
    return plan


def plan_here(config: Config, ranks_per_node: int | None = None, world_size: int | None = None
              ) -> tuple[MemoryPlan, str]:
    """`cpudist plan` and cpudist.plan(): the plan for ranks_per_node ranks of a world_size run
    (default: what the launcher says, else one node), with the batch line resolve_batch gives."""
    from cpudist.runtime.cluster import detect_placement

    placement = detect_placement()
    ranks = ranks_per_node or placement.local_size
    world = world_size or max(placement.world_size, ranks)
    config, batch_line = resolve_batch(config, world, ranks)
    return make_plan(config, ranks, world), batch_line


def describe(plan: MemoryPlan) -> str:
    if plan.frozen_gb:
        lines = [f"frozen weights ({'once per node, mapped' if plan.frozen_shared else 'per rank'}):"]
        lines += [f"  {name:<34} {gb:7.2f} GB" for name, gb in plan.frozen_gb.items()]
    else:
        lines = ["frozen weights: none (every weight trains)"]
    lines.append(f"each rank ({plan.ranks_per_node} per node):")
    lines += [f"  {name:<34} {gb:7.2f} GB" for name, gb in plan.rank_gb.items()]
    lines.append(f"peak per rank {plan.rank_peak_gb:.2f} GB; node peak {plan.node_peak_gb:.2f} GB "
                 f"of {plan.node_memory_gb:.1f} GB ({plan.node_memory_from})")
    lines.append("fits" if plan.fits else "does NOT fit" + (
        f"; would fit with: {'; or '.join(plan.advice)}" if plan.advice else
        "; nothing tried here makes it fit (a bigger node, or more nodes with fewer ranks each)"))
    return "\n".join(lines)


def one_line(plan: MemoryPlan) -> str:
    advice = f"; it would fit with {plan.advice[0]}" if plan.advice else ""
    return (f"this run needs about {plan.node_peak_gb:.1f} GB per node ({plan.ranks_per_node} "
            f"rank(s)) and the node has {plan.node_memory_gb:.1f} GB ({plan.node_memory_from})"
            f"{advice}; `cpudist plan` shows the parts, train.check_memory=false runs anyway")


def check_fits(config: Config, ranks_per_node: int, world_size: int | None = None
               ) -> MemoryPlan | None:
    """The plan, raising a one-line UserError when it does not fit (train.check_memory=false
    skips the check). Never stops a run because the plan itself failed."""
    if not config.train.check_memory:
        return None
    try:
        plan = make_plan(config, ranks_per_node, world_size)
    except UserError:
        raise
    except Exception as exc:  # a model the planner cannot count: say so, run anyway
        log.warning("memory plan unavailable (%s); running without the check", exc)
        return None
    if not plan.fits:
        raise PlanRefused(one_line(plan))
    log.info("memory plan: node peak about %.1f GB of %.1f GB (%s)", plan.node_peak_gb,
             plan.node_memory_gb, plan.node_memory_from)
    return plan



# --------------------------------------------------------------------------- the micro-batch

# batch_size=auto tries micro-batches up to this many rows. Past a few hundred tokens the GEMMs
# are as fast as they get and only memory grows: Qwen2.5-0.5B shape, 512 tokens, AMX Xeon, tokens/s
# at micro-batch 1 / 2 / 4 / 8 = 331 / 316 / 370-387 / 360, peak 2.6 / 3.3 / 4.6 / 9.1 GB
# (docs/PERFORMANCE.md, "Micro-batch").
MAX_AUTO_BATCH = 4


def resolve_batch(config: Config, world_size: int, ranks_per_node: int) -> tuple[Config, str]:
    """The config with a concrete train.batch_size and train.grad_accum for this world size, and
    a line for the log. train.global_batch, when set, is kept exactly or the run stops."""
    tc = config.train
    if tc.global_batch is None:
        if tc.batch_size == "auto":
            raise UserError("train.batch_size=auto needs train.global_batch (rows per optimizer "
                            "step over all ranks), so that the choice never changes what a step "
                            "trains on; e.g. train.global_batch=16")
        return config, ""
    per_rank, rest = divmod(tc.global_batch, world_size)
    if rest:
        raise UserError(f"train.global_batch={tc.global_batch} does not divide among {world_size} "
                        f"ranks; choose a multiple of {world_size}")
    if tc.batch_size == "auto":
        batch, why = _auto_batch(config, per_rank, ranks_per_node, world_size)
    else:
        batch, why = tc.batch_size, "train.batch_size"
        if per_rank % batch:
            raise UserError(f"train.global_batch={tc.global_batch} over {world_size} rank(s) is "
                            f"{per_rank} rows per rank, which train.batch_size={batch} does not "
                            "divide; choose a divisor or train.batch_size=auto")
    accum = per_rank // batch
    if tc.grad_accum not in (1, accum):
        raise UserError(f"train.grad_accum={tc.grad_accum} contradicts train.global_batch="
                        f"{tc.global_batch} ({world_size} rank(s) x batch {batch} x accumulation "
                        f"{accum}); leave train.grad_accum out, it follows from the global batch")
    resolved = _with(config, [f"train.batch_size={batch}", f"train.grad_accum={accum}"])
    return resolved, (f"global batch {tc.global_batch} = {world_size} rank(s) x micro-batch {batch} "
                      f"x {accum} accumulation step(s) ({why})")


def keep_global_batch(config: Config, global_batch: int, world_size: int) -> tuple[Config, str]:
    """The config for continuing, on world_size ranks, a run that trained with global_batch rows
    per step: train.global_batch set to it, the micro-batch lowered if it no longer divides the
    per-rank share (accumulation makes up the rest, in resolve_batch)."""
    tc = config.train
    if tc.global_batch not in (None, global_batch):
        raise UserError(f"the checkpoint trained with a global batch of {global_batch} rows; "
                        f"train.global_batch={tc.global_batch} would change it: resume with "
                        f"train.global_batch={global_batch}, or start a new run from the adapter")
    if global_batch % world_size:
        working = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
        raise UserError(f"the checkpoint's global batch of {global_batch} rows does not divide "
                        f"among {world_size} ranks; resume on {', '.join(map(str, working))} "
                        "ranks, or start a new run from the adapter")
    per_rank = global_batch // world_size
    overrides = [f"train.global_batch={global_batch}", "train.grad_accum=1"]
    note = f"global batch {global_batch} kept on {world_size} rank(s)"
    if tc.batch_size != "auto" and per_rank % tc.batch_size:
        batch = max(b for b in range(1, tc.batch_size + 1) if per_rank % b == 0)
        overrides.append(f"train.batch_size={batch}")
        note += f"; micro-batch {tc.batch_size} -> {batch}"
    return _with(config, overrides), note


def _auto_batch(config: Config, per_rank: int, ranks_per_node: int, world_size: int
                ) -> tuple[int, str]:
    """The largest micro-batch (<= MAX_AUTO_BATCH, dividing per_rank) whose plan fits."""
    from cpudist.runtime.memory import node_memory_gb
    from cpudist.runtime.precision import choose_precision

    candidates = [b for b in range(min(per_rank, MAX_AUTO_BATCH), 0, -1) if per_rank % b == 0]
    try:
        parts = model_parts(config)
    except UserError:
        raise
    except Exception as exc:  # a model the planner cannot count: the smallest safe choice
        log.warning("batch_size=auto: memory plan unavailable (%s); using 1", exc)
        return 1, "auto: no memory plan for this model, so 1"
    compute = choose_precision(config.model.dtype).compute
    node = node_memory_gb()
    for batch in candidates:
        if estimate(_with(config, [f"train.batch_size={batch}"]), parts, ranks_per_node, node,
                    compute, world_size).fits:
            return batch, f"auto: the largest of {candidates} that the memory plan fits"
    return 1, "auto: even 1 row does not fit the memory plan"
