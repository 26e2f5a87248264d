#!/usr/bin/env python3
"""Can DCP's own DefaultStager replace the recipe's staging for dcp.async_save (docs/CHECKPOINTS.md)?

An FSDP2 model of square Linear layers holding about --gib GiB of fp32 state per rank (weights and AdamW's two
moments) saves --saves times, one training step apart, through a gloo group, in three ways:
  default_stager   one DefaultStager(StagingOptions(pinned, no shared memory, async staging, non-blocking copies)),
                   reused for every save, as torchtitan keeps one
  per_save_stager  a new DefaultStager for every save, closed after it
  recipe           train.Checkpointer.save(): host buffers allocated and pinned once, reused by every save
Per save: the training stall (until the weights may change again), the time until the write is done, and a
check that the checkpoint loads back equal to the state at save time. A failing save is reported and ends its
variant.

  torchrun --standalone --nproc_per_node=1 bench/dcp_stager.py --gib 8 --saves 4 --out /tmp/stager
"""

import argparse
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train  # noqa: E402


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def snapshot(state: dict) -> dict:
    """A host copy of every tensor of the state, by key path."""
    copies = {}
    train.walk_tensors(state, lambda key, t: copies.setdefault(key, local(t).detach().cpu().clone()))
    return copies


def loaded_difference(state: dict, path: Path, copies: dict, group) -> float:
    """The largest difference between the checkpoint at path and copies."""
    target = train.walk_tensors(state, lambda key, t: t.detach().clone().zero_() if t.dim() else t.detach().clone())
    dcp.load(target, checkpoint_id=str(path), process_group=group)
    diffs = []
    train.walk_tensors(target, lambda key, t: diffs.append((local(t).cpu().float() - copies[key].float()).abs().max()))
    return max(float(d) for d in diffs if d.numel()) if diffs else 0.0


def build(gib: float, d: train.Dist):
    width = 4096 if gib >= 1 else 512
    layers = max(2, round(gib * 2**30 / 3 * d.world_size / (width * width * 4)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False, device=d.device) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=d.device.type == "cuda")
    return model, optimizer, width


def step(model, optimizer, width: int, d: train.Dist) -> None:
    model(torch.randn(8, width, device=d.device)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_variant(name: str, args, d: train.Dist) -> list[dict]:
    model, optimizer, width = build(args.gib, d)
    step(model, optimizer, width, d)
    pinned = d.device.type == "cuda"
    options = StagingOptions(use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=True,
                             use_non_blocking_copy=pinned)  # fmt: skip
    kept = DefaultStager(options) if name == "default_stager" else None
    out = Path(args.out) / name
    if name == "recipe":
        cfg = train.Config(output_dir=str(out), save_every=1, keep_checkpoints=1, async_save=True, compile=False)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        job = train.Job(cfg, d, model, optimizer, scheduler, args.saves, train.Progress(step=1), {})
        checkpointer = train.Checkpointer(job)
        checkpointer.prepare()
        checkpointer.preparing.join()  # the buffers, as after a run's first step
    group, rows = dist.new_group(backend="gloo"), []
    for i in range(args.saves):
        row = {"variant": name, "save": i + 1}
        rows.append(row)
        try:
            if i:
                step(model, optimizer, width, d)
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
            copies = snapshot(state)
            if pinned:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            if name == "recipe":
                job.progress.step = i + 1
                checkpointer.save()
                row["stall_s"] = time.perf_counter() - t0
                step(model, optimizer, width, d)  # the weights move on during the write
                checkpointer.finish()
                path = out / "checkpoints" / f"step_{i + 1:08d}"
            else:
                path = out / f"save{i + 1}"
                stager = kept or DefaultStager(options)
                response = dcp.async_save(state, checkpoint_id=str(path), process_group=group, async_stager=stager)
                response.staging_completion.result()
                row["stall_s"] = time.perf_counter() - t0
                step(model, optimizer, width, d)
                response.upload_completion.result()
                if stager is not kept:
                    stager.close()
            row["write_s"] = time.perf_counter() - t0
            row["max_diff"] = loaded_difference(state, path, copies, group)
            if d.rank == 0:
                print(f"[{name}] {row}", flush=True)
            dist.barrier()
            if d.rank == 0 and name != "recipe":
                shutil.rmtree(path, ignore_errors=True)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            print(
                f"[{name}] rank {d.rank}, save {i + 1} failed:\n{''.join(traceback.format_exception(e)[-4:])}",
                flush=True,
            )
            break
    if kept:
        kept.close()
    dist.destroy_process_group(group)
    if d.rank == 0:
        shutil.rmtree(out, ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=8.0, help="fp32 state per rank")
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--out", default="/tmp/stager")
    parser.add_argument("--variants", default="default_stager,per_save_stager,recipe")
    args = parser.parse_args()
    d = train.setup_distributed()
    rows = [row for name in args.variants.split(",") for row in run_variant(name, args, d)]
    if d.rank == 0:
        print(f"torch {torch.__version__}, {d.world_size} rank(s), {args.gib} GiB of state per rank (rank 0's times)")
        print(f"{'variant':16} {'save':>4} {'stall s':>8} {'write s':>8}  loaded back")
        for r in rows:
            check = r["error"][:80] if "error" in r else f"max difference {r['max_diff']}"
            stall, write = (f"{r[k]:8.3f}" if k in r else f"{'-':>8}" for k in ("stall_s", "write_s"))
            print(f"{r['variant']:16} {r['save']:>4} {stall} {write}  {check}")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
