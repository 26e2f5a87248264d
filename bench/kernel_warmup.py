"""A lever for the first step, measured before it goes into train.py (issue 25, target 5): flash-linear-attention's
Triton autotuning compiled by several processes while the weights load.

On a machine with an empty Triton cache, step 1 compiles each autotuned fla kernel's configurations one after
another, about 118 for the Qwen3.5 geometry (130-156 s on one H200, docs/BENCHMARKS.md). Here, while the recipe
loads the weights, up to 8 processes each compile their share of every kernel's configurations, through one Gated
DeltaNet layer's forward and backward on a packed block; step 1 waits for them, then benchmarks every configuration
as before, finding each one compiled in Triton's cache. A marker in that cache makes a restart skip the warm-up.

It is not in train.py: its ~45 lines are over train.py's 2,100-line shape (the issue "The recipe again"), where the
file already is. bench.py's `ours --kernel-warmup` calls install(), which wraps two of train.py's functions: the
warm-up starts when train.build_model is called (model config and settings known) and is waited for at the start
of train.training_loop, before step 1's first forward.
"""

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

BENCH = Path(__file__).resolve().parent


class KernelWarmup:
    def __init__(self, cfg, config, device: torch.device):
        self.t0, self.procs, text = time.perf_counter(), [], config.get_text_config()
        self.applies = device.type == "cuda" and "linear_attention" in (getattr(text, "layer_types", None) or [])
        if not self.applies or int(os.environ.get("LOCAL_RANK", "0")):
            return  # one rank per node starts them: the node's ranks share Triton's cache
        import fla
        import triton

        versions = [torch.__version__, triton.__version__, fla.__version__, torch.cuda.get_device_name()]
        key = [text.to_dict(), cfg.max_seq_len > 65536, cfg.param_dtype, versions]  # what the kernels depend on
        key = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.marker = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton/cache") / "sft_warmed" / key
        if self.marker.exists():  # a restart: Triton's cache (workload.yaml keeps it on the volume) has them all
            return
        # 8: 15 processes beside the 8-layer geometry's weights ran out of memory on one H200 (~7.7 GB each at 16k).
        shares = min(8, max(1, len(os.sched_getaffinity(0)) - 1))
        env = {**os.environ, "FLA_CACHE_RESULTS": "0"}  # a share's autotuning result is not the kernel's
        for share in range(shares):
            args = [cfg.model_name, cfg.model_revision, cfg.trust_remote_code, cfg.max_seq_len, cfg.param_dtype, share]
            code = f"import sys; sys.path[:0] = [{str(BENCH.parent)!r}, {str(BENCH)!r}]; import kernel_warmup; "
            code += f"kernel_warmup.warm_share(*{args!r}, {shares}, {os.getpid()})"
            log = tempfile.TemporaryFile()  # what a failed share printed, for the log line
            self.procs.append((subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=log, env=env), log))

    def wait(self) -> None:  # before step 1, on every rank: its autotuning then finds each configuration compiled
        if not self.applies:
            return
        waited, failed = time.perf_counter(), []
        for proc, log in self.procs:
            if proc.wait():
                log.seek(0)
                failed.append(log.read().decode(errors="replace").strip().rpartition("\n")[2][:200])
            log.close()
        dist.barrier()
        if self.procs:  # failed ones too: step 1 compiles what they left, and they would fail alike on a restart
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.touch()
            line = f"{len(self.procs)} processes compiled fla's kernels, {waited - self.t0:.1f}s behind the load, then"
            line += f" {time.perf_counter() - waited:.1f}s before step 1"
            line += f"; {len(failed)} failed, step 1 compiles their share ({failed[0]})" if failed else ""
            print(f"kernel warm-up: {line}", flush=True)


def warm_share(model_name, revision, remote_code, seq_len, dtype, share: int, shares: int, rank_pid: int) -> None:
    """A warm-up process: its share of each autotuned kernel's configurations, compiled through one linear-attention
    layer's forward and backward on a packed block of up to 16k tokens (fla's tuning keys are head counts and sizes;
    l2norm's also cdiv(T, 65536): the marker's long-block flag). Triton's cache keeps what it compiled."""
    from transformers import AutoModelForCausalLM
    from triton.runtime.autotuner import Autotuner

    import train

    train.start_data_worker(rank_pid, share)  # it dies with the rank
    every = Autotuner.prune_configs  # a config list shorter than the shares: a share compiles one the others do too
    Autotuner.prune_configs = lambda tuner, *a, **k: (c := every(tuner, *a, **k))[share::shares] or [c[share % len(c)]]
    text = train.model_config(model_name, revision, remote_code).get_text_config()
    small = {"vocab_size": 256, "pad_token_id": None, "intermediate_size": 64}  # what fla's kernels never see
    one = {"num_hidden_layers": 1, "layer_types": ["linear_attention"], **small}
    device = torch.device("cuda", share % torch.cuda.device_count())
    with torch.device(device):  # in the compute dtype, as FSDP casts the weights for the forward
        model = AutoModelForCausalLM.from_config(type(text).from_dict(text.to_dict() | one), dtype=dtype)
    n = min(seq_len, 16384) // 4  # three conversations and padding
    block = train.to_device(train.make_block([([1] * n, [True] * n)] * 3, 4 * n, 0), device)
    model.get_decoder()(**train.packed_inputs(block)).last_hidden_state.float().square().mean().backward()


def install() -> None:
    """From now on, train.build_model starts a warm-up for the model it builds, and train.training_loop waits for it."""
    import train

    build_model, training_loop, started = train.build_model, train.training_loop, []

    def build_warmed(config, cfg, attn, device):
        started.append(KernelWarmup(cfg, config, device))
        return build_model(config, cfg, attn, device)

    def loop_warmed(job, blocks, operations):
        started.pop().wait()
        return training_loop(job, blocks, operations)

    train.build_model, train.training_loop = build_warmed, loop_warmed
