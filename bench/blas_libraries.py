"""BENCH: the 8-layer geometry's matrix multiplies under cuBLAS and cuBLASLt (`preferred_blas_library`), in turn
twice, on one GPU with random bf16 data: does the other library run train.py's GEMMs faster?

    python3 bench/blas_libraries.py

Each linear shape of the decoder layers at 16,384 tokens: the forward, the input gradient and the weight gradient,
20 runs each; the LM head's 4,096-row chunks (HeadLoss: the logits, then both gradients added into their buffers),
10 runs each. Prints each shape's three times (ms) and TFLOP/s, and their sum over a step: each shape times its count
(LINEAR_SHAPES, checked against the geometry by tests/test_bench.py), the head's chunks times HEAD_CHUNKS (an estimate:
the bench's 16k blocks hold about 10-12k loss tokens). docs/BENCHMARKS.md, twenty-seventh round."""

import torch
import torch.nn.functional as F
from adamw_kernels import timed  # bench/: two warm-up runs, then CUDA events over the timed ones

TOKENS, HEAD_ROWS, HIDDEN, VOCAB, HEAD_CHUNKS = 16384, 4096, 5120, 248320, 2.7
LINEAR_SHAPES = {  # (out, in): how many in the 8 layers (6 Gated DeltaNet, 2 gated attention)
    (17408, 5120): 16,  # MLP gate and up
    (5120, 17408): 8,  # MLP down
    (10240, 5120): 6,  # Gated DeltaNet q, k, v
    (6144, 5120): 6,  # Gated DeltaNet z
    (48, 5120): 12,  # Gated DeltaNet b and a
    (5120, 6144): 8,  # Gated DeltaNet out (6), attention o (2)
    (12288, 5120): 2,  # attention q and its gate
    (1024, 5120): 4,  # attention k and v
}


def linear_ms(out: int, inp: int) -> list[float]:  # forward, input gradient, weight gradient
    on = dict(device="cuda", dtype=torch.bfloat16)
    x, w, dy = torch.randn(TOKENS, inp, **on), torch.randn(out, inp, **on), torch.randn(TOKENS, out, **on)
    return [timed(fn, 20) for fn in (lambda: F.linear(x, w), lambda: dy @ w, lambda: dy.t() @ x)]


def head_chunk_ms() -> list[float]:  # HeadLoss's chunk: the logits, then both gradients added into their buffers
    on = dict(device="cuda", dtype=torch.bfloat16)
    h, g, head = (
        torch.randn(HEAD_ROWS, HIDDEN, **on),
        torch.randn(HEAD_ROWS, VOCAB, **on),
        torch.randn(VOCAB, HIDDEN, **on),
    )
    grad_h, grad_w = torch.zeros_like(h), torch.zeros_like(head)
    gemms = (lambda: h @ head.T, lambda: grad_h.addmm_(g, head), lambda: grad_w.addmm_(g.T, h))
    return [timed(fn, 10) for fn in gemms]


def main() -> None:
    for library in ["cublas", "cublaslt", "cublas", "cublaslt"]:
        torch.backends.cuda.preferred_blas_library(library)
        rows = [
            (f"{out} {inp}", linear_ms(out, inp), count, 6 * TOKENS * out * inp)
            for (out, inp), count in LINEAR_SHAPES.items()
        ]
        rows.append((f"head {HEAD_ROWS}", head_chunk_ms(), HEAD_CHUNKS, 6 * HEAD_ROWS * VOCAB * HIDDEN))
        total = sum(count * sum(ms) for _, ms, count, _ in rows)
        print(library, f"total {total:.1f} ms a step (layers + {HEAD_CHUNKS} head chunks)", flush=True)
        for shape, ms, _, flops in rows:
            print("  ", shape, " ".join(f"{v:.3f}" for v in ms), f"{flops / sum(ms) / 1e9:.0f} TFLOP/s", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
