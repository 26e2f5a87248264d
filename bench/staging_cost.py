#!/usr/bin/env python3
"""Where an asynchronous checkpoint's training stall goes (docs/CHECKPOINTS.md): the staging copy of one rank's
state to host memory, split into its parts, on one GPU. Each part is timed twice in one process: the first time
also pays for the host memory the machine hands out first (a virtual machine grows its memory on first use).

    python3 bench/staging_cost.py GIB [--chunk-mib 512]

  alloc+pin     host buffers allocated, then pinned in place (cudaHostRegister): what DCP's stager does per save
  pinned alloc  torch.empty(pin_memory=True) (cudaHostAlloc)
  copy pinned   device-to-host copy into pinned buffers that already exist: all a reused stager would pay
  copy pageable device-to-host copy into fresh pageable buffers (use_pinned_memory off)
"""

import argparse
import time

import torch


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gib", type=float, help="state per rank, GiB (the 8-layer geometry on 2 ranks: 32.1)")
    parser.add_argument("--chunk-mib", type=int, default=512, help="tensor size: the state is many tensors")
    args = parser.parse_args()
    n_chunks = int(args.gib * 1024 / args.chunk_mib)
    numel = args.chunk_mib * 2**20 // 4
    device_state = [torch.randn(numel, device="cuda") for _ in range(n_chunks)]
    gib = n_chunks * args.chunk_mib / 1024

    def alloc_and_register():
        buffers = [torch.empty(numel) for _ in range(n_chunks)]
        for b in buffers:
            b.fill_(0)  # first touch, as the copy into it would
            torch.cuda.cudart().cudaHostRegister(b.data_ptr(), b.nbytes, 0)
        for b in buffers:
            torch.cuda.cudart().cudaHostUnregister(b.data_ptr())

    pinned = []
    rows = []
    for attempt in (1, 2):
        rows.append((f"alloc+pin #{attempt}", timed(alloc_and_register)))
        pinned.clear()
        rows.append(
            (
                f"pinned alloc #{attempt}",
                timed(lambda: pinned.extend(torch.empty(numel, pin_memory=True) for _ in range(n_chunks))),
            )
        )
        rows.append(
            (
                f"copy pinned #{attempt}",
                timed(lambda: [p.copy_(d, non_blocking=True) for p, d in zip(pinned, device_state)]),
            )
        )
        rows.append((f"copy pageable #{attempt}", timed(lambda: [d.to("cpu") for d in device_state])))
    print(f"staging {gib:.1f} GiB in {n_chunks} tensors of {args.chunk_mib} MiB")
    for name, seconds in rows:
        print(f"{name:20s} {seconds:6.2f} s  {gib / seconds:6.1f} GiB/s")


if __name__ == "__main__":
    main()
