"""Run under `mpirun -np N` by tests/train/test_distributed.py: cpudist's own DDP wrapping, checked
per rank.

For each gradient path given on the command line (gloo, mpi, mpi-nonblocking, and each of them
with -bf16: dist.grad_compression=bf16) this builds the tiny
model through cpudist.model, wraps it with cpudist.train.engine.wrap_ddp over the group from
cpudist.runtime.comm.init_process_group, runs one optimizer step's micro-batches (this rank's shard from
GlobalBatches, no_sync on all but the last) and checks, against all_gather'ed values:
  - DDP holds only the LoRA parameters;
  - the ranks' shards are disjoint and the same size;
  - after a no_sync micro-step the ranks' gradients still differ (nothing was communicated);
  - after the last micro-step they are bit-identical on every rank and equal the mean of the
    ranks' local gradients (to bf16's precision for -bf16 paths);
  - for mpi paths, the mpi4py communication hook carried every bucket.
Prints one `DDP-CHECK-OK <path> rank=<r>` line per path; any failed check raises (non-zero exit).
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch
import torch.distributed as dist

from cpudist.config import load_config
from cpudist.data.batches import GlobalBatches, collate
from cpudist.data.tokenize import build_datasets
from cpudist.model.adapters import trainable_parameters
from cpudist.model.load import build_model
from cpudist.model.loss import CausalLMLoss
from cpudist.runtime.cluster import detect_placement
from cpudist.runtime.comm import init_process_group
from cpudist.runtime.precision import choose_precision
from cpudist.train import engine


def gather_flat(tensors: list[torch.Tensor], world: int) -> list[torch.Tensor]:
    flat = torch.cat([t.reshape(-1) for t in tensors]).contiguous()
    out = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(out, flat)
    return out


def check(path: str, model_dir: str, data_file: str, cache: str) -> None:
    placement = detect_placement()
    rank, world = placement.rank, placement.world_size
    transport = path.removesuffix("-bf16")
    compressed = path.endswith("-bf16")
    backend = "gloo" if transport == "gloo" else "mpi"
    config = load_config(None, [
        f"model.path={model_dir}", "model.dtype=float32", f"data.path={data_file}",
        "data.format=chat", f"data.cache_dir={cache}", "data.max_length=64", "lora.dropout=0.0",
        f"dist.backend={backend}", f"dist.mpi_nonblocking={transport == 'mpi-nonblocking'}",
        f"dist.grad_compression={'bf16' if compressed else 'none'}",
        "train.batch_size=2", "train.grad_accum=2", "train.loss_chunk_size=0",
    ])
    torch.manual_seed(config.train.seed)
    peft_model, tokenizer, _ = build_model(config, choose_precision(config.model.dtype))
    train_data, _, _ = build_datasets(config.data, tokenizer, config.train.seed)
    module = CausalLMLoss(peft_model, config.train.loss_chunk_size)
    params = [p for _, p in trainable_parameters(module)]

    batches = GlobalBatches(train_data, config.train.batch_size, config.train.grad_accum, world,
                            config.train.seed, config.data.group_by_length)
    mine = batches.step_batches(0, 0, rank)
    shards = [None] * world
    dist.all_gather_object(shards, (batches.steps_per_epoch, sorted(i for ix in mine for i in ix)))
    assert len({steps for steps, _ in shards}) == 1, "every rank must get the same number of steps"
    seen = [i for _, indices in shards for i in indices]
    assert len(seen) == len(set(seen)), f"rank shards overlap: {shards}"
    assert len({len(indices) for _, indices in shards}) == 1

    pad = tokenizer.pad_token_id
    # Local gradients before DDP wraps the module: what the allreduced ones must average to.
    for ix in mine:
        loss_sum = module(**collate(train_data, ix, pad).as_kwargs()).total
        loss_sum.backward()
    local = [p.grad.detach().clone() for p in params]
    for p in params:
        p.grad = None

    hook_calls = []
    original_hook = engine.gradient_hook

    def counting_hook(*args, **kwargs):  # type: ignore[no-untyped-def]
        inner, wire_bytes = original_hook(*args, **kwargs)

        # wraps: DDP checks the signature of the hook it is given, i.e. cpudist's own.
        @functools.wraps(inner)
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            hook_calls.append(bucket.buffer().numel())
            return inner(state, bucket)

        return hook, wire_bytes

    engine.gradient_hook = counting_hook
    meter = engine.CommMeter()
    try:
        ddp = engine.wrap_ddp(module, config, meter)
    finally:
        engine.gradient_hook = original_hook

    in_ddp = {id(p) for p in ddp._module_parameters}
    assert in_ddp == {id(p) for p in params}, "DDP must hold exactly the trainable parameters"
    names = [name for name, p in module.named_parameters() if id(p) in in_ddp]
    assert names and all("lora_" in name for name in names), names

    for k, ix in enumerate(mine):
        last = k == len(mine) - 1
        with ddp.no_sync() if not last else contextlib.nullcontext():
            loss_sum = ddp(**collate(train_data, ix, pad).as_kwargs()).total
            loss_sum.backward()
        grads = gather_flat([p.grad for p in params], world)
        identical = all(torch.equal(grads[0], g) for g in grads[1:])
        if not last:
            assert not identical, "gradients identical under no_sync: something communicated"
            assert not hook_calls, "the hook ran during a no_sync micro-step"
    assert identical, "gradients differ across ranks after the synchronising micro-step"
    expected = torch.stack(gather_flat(local, world)).mean(dim=0)
    numel = sum(p.numel() for p in params)
    if compressed:
        # bf16 keeps 8 bits of mantissa: each value within a few parts in 1000 of the fp32 mean.
        torch.testing.assert_close(grads[rank], expected, rtol=2e-2, atol=1e-3 * float(
            expected.abs().max()))
        assert not torch.equal(grads[rank], expected), "bf16 compression did not round anything"
    else:
        torch.testing.assert_close(grads[rank], expected, rtol=1e-5, atol=1e-8)
    assert hook_calls and sum(hook_calls) == numel, hook_calls
    # The meter counts what crossed the wire: 2 bytes per gradient element in bf16, else 4.
    # ... and the last bucket's share of them, the one backward hands over last.
    taken = meter.take()
    assert taken["bytes"] == numel * (2 if compressed else 4)
    assert taken["last_bucket_bytes"] == hook_calls[-1] * (2 if compressed else 4), taken
    print(f"DDP-CHECK-OK {path} rank={rank} buckets={len(hook_calls)}", flush=True)


def main() -> None:
    model_dir, data_file, cache, *paths = sys.argv[1:]
    placement = detect_placement()
    assert placement.world_size > 1, "run me under mpirun -np 2 (or more)"
    print(init_process_group(placement, "mpi" if "mpi" in paths else "gloo", None, None, None, 60),
          flush=True)
    try:
        for path in paths:
            check(path, model_dir, data_file, cache)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
