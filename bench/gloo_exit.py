#!/usr/bin/env python3
"""Why train.py's main() leaves through os._exit (BENCHMARKS.md, ninth round): a gloo process group that outlives
destroy_process_group, as FSDP keeps it, can abort a finished process in the interpreter's teardown (SIGABRT,
'terminate called without an active exception'). One run is two ranks; RUNS of them per variant, CPU only:

    python bench/gloo_exit.py [RUNS]

Variants: plain (no reference kept: the group is freed at destroy_process_group), kept (a reference outlives it),
kept+os._exit (as main() leaves). Prints how many runs of each ended in an abort.
"""

import os
import subprocess
import sys

WORKER = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
kept = [dist.group.WORLD] if sys.argv[1] != "plain" else []
out = [torch.empty(1) for _ in range(dist.get_world_size())]
dist.all_gather(out, torch.tensor([float(dist.get_rank())]))
del out
dist.destroy_process_group()
if sys.argv[1] == "kept+os._exit":
    sys.stdout.flush(), os._exit(0)
"""


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    for variant in ("plain", "kept", "kept+os._exit"):
        aborted = 0
        for _ in range(runs):
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
            proc = subprocess.run(
                [*command, "--no-python", sys.executable, "-c", WORKER, variant],
                capture_output=True,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            aborted += "terminate called" in proc.stderr + proc.stdout or proc.returncode != 0
        print(f"{variant}: {aborted} of {runs} runs aborted", flush=True)


if __name__ == "__main__":
    main()
