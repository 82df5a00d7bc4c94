#!/usr/bin/env python3
"""kvbank — the peer for kvbank-bench cuda's attention rows: PyTorch's scaled_dot_product_attention
on the same shapes (Llama-3-8B: 32 query heads, 8 KV heads, head_dim 128, bf16), timed with CUDA
events over every layer as kvbank-bench times its attention operator.

  decode:  one query row per sequence over a dense [ctx] K/V (kvbank reads paged blocks), batch x ctx
  prefill: one causal sequence of N tokens

Prints one line per shape: the backend PyTorch used, ms for all layers (median of --reps, min-max),
and the KV (decode) or TFLOP/s (prefill) rate. Runs only on a CUDA device (exit 77 otherwise)."""
import argparse
import statistics
import sys


def time_cuda(fn, reps):
    """ms of fn() timed with CUDA events, reps times: (median, min, max). Also bench/compiled_peer.py's."""
    import torch
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), min(times), max(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--decode", default="1x8192,16x8192,64x4096", help="batch x ctx pairs, comma-separated")
    ap.add_argument("--prefill", type=int, default=8192, help="causal prefill tokens (0: none)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        print(f"SKIP: {e}")
        return 77
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 77
    H, KV, D, L = 32, 8, 128, args.layers
    dev, dt = "cuda", torch.bfloat16

    def timed(fn):
        for _ in range(2):
            fn()
        return time_cuda(fn, args.reps)

    def run(q, k, v, causal):
        """SDPA with the flash backend where it takes the shape, else the best other; returns its name."""
        for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel(be):
                    F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
                torch.cuda.synchronize()
            except RuntimeError:
                continue

            def fn():
                with sdpa_kernel(be):
                    for _ in range(L):
                        F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

            return be.name.lower(), timed(fn)
        return None, None

    print(f"PyTorch {torch.__version__} scaled_dot_product_attention on {torch.cuda.get_device_name()}, "
          f"bf16, {H} heads / {KV} KV heads / head_dim {D}, {L} layers, median of {args.reps} (min-max)")
    for pair in filter(None, args.decode.split(",")):
        bsz, ctx = (int(x) for x in pair.split("x"))
        q = torch.randn(bsz, H, 1, D, device=dev, dtype=dt)
        k = torch.randn(bsz, KV, ctx, D, device=dev, dtype=dt)
        v = torch.randn(bsz, KV, ctx, D, device=dev, dtype=dt)
        name, t = run(q, k, v, False)
        if not name:
            print(f"  sdpa decode  batch {bsz:3d} ctx {ctx:5d}   no backend took the shape")
            continue
        gb = 2 * k.numel() * 2 * L / 1e9
        print(f"  sdpa decode  batch {bsz:3d} ctx {ctx:5d}  {t[0]:9.3f} ms ({t[1]:.3f}-{t[2]:.3f})  "
              f"{gb / (t[0] / 1e3):7.0f} GB/s  [{name}]")
        del q, k, v
    if args.prefill:
        n = args.prefill
        q = torch.randn(1, H, n, D, device=dev, dtype=dt)
        k = torch.randn(1, KV, n, D, device=dev, dtype=dt)
        v = torch.randn(1, KV, n, D, device=dev, dtype=dt)
        name, t = run(q, k, v, True)
        flop = 4.0 * H * D * n * (n + 1) / 2 * L  # QK^T and PV over the causal half
        if name:
            print(f"  sdpa prefill {n:5d} tokens causal  {t[0]:9.3f} ms ({t[1]:.3f}-{t[2]:.3f})  "
                  f"{flop / (t[0] / 1e3) / 1e12:7.1f} TFLOP/s  [{name}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
