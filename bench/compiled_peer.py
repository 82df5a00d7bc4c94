#!/usr/bin/env python3
"""kvbank — the compiled peer for kvbank-bench cuda's decode and prefill rows: transformers' Llama at the
same shape (Llama-3-8B by default: 32 layers, hidden 4096, 32 heads over 8 KV heads of 128, intermediate
14336, vocabulary 128256, bf16) with a static KV cache under torch.compile, the gpt-fast recipe (a decode
step compiled with mode="reduce-overhead", fullgraph, so it replays as one CUDA graph; the prefill
compiled for its shape). Random weights made on the device from a LlamaConfig: nothing is downloaded
(HF_HUB_OFFLINE=1 is set before transformers is imported), so it runs on a machine without network.

  decode:  one token per sequence at position ctx - 1 of a static cache of ctx tokens, batch x ctx
  prefill: one sequence of N tokens into an empty static cache (causal)

Every timed call ends with the logits of the rows kvbank-bench also computes (the last row of each
sequence). Prints one line per shape, which kvbank-bench cuda --peer parses:
  peer decode  batch B ctx C  MS ms (MIN-MAX)
  peer prefill N tokens  MS ms (MIN-MAX)
(medians of --reps timed with CUDA events, after warm-up calls that include the compilation). Exit 77
without torch, transformers or a CUDA device. Compilation takes about a minute per shape on an H100."""
import argparse
import inspect
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sdpa_peer import time_cuda  # noqa: E402  (the same event timing as the attention peer)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--decode", default="1x1024", help="batch x ctx pairs, comma-separated ('' for none)")
    ap.add_argument("--prefill", type=int, default=8192, help="prefill tokens (0: none)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-compile", action="store_true", help="eager (to tell the compiler's share)")
    args = ap.parse_args()
    try:
        import torch
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM, StaticCache
    except ImportError as e:
        print(f"SKIP: {e}")
        return 77
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 77
    dev, dt = "cuda", torch.bfloat16
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                      vocab_size=args.vocab, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    t0 = time.time()
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(dt).eval()
    print(f"compiled peer: transformers {transformers.__version__} LlamaForCausalLM, PyTorch {torch.__version__} "
          f"on {torch.cuda.get_device_name()}, bf16, {args.layers} layers, hidden {args.hidden}, "
          f"{args.heads}/{args.kv_heads} heads of {args.head_dim}, static cache, "
          f"{'eager' if args.no_compile else 'torch.compile'} (model made in {time.time() - t0:.1f} s), "
          f"median of {args.reps} (min-max)", flush=True)

    def make_cache(batch, length):
        """A StaticCache of batch x length, with whatever constructor arguments this version takes."""
        params = inspect.signature(StaticCache.__init__).parameters
        kw = {"config": cfg, "max_cache_len": length}
        for name, value in (("max_batch_size", batch), ("batch_size", batch), ("device", dev), ("dtype", dt)):
            if name in params:
                kw[name] = value
        return StaticCache(**kw)

    def timed(fn):
        return time_cuda(fn, args.reps)

    def rewind(cache, n):
        """transformers 5's static layers write at a count of their own (cumulative_length) and ignore
        cache_position: every call of a step must start from the same n (earlier versions keep no count)."""
        for layer in getattr(cache, "layers", []):
            c = getattr(layer, "cumulative_length", None)
            if isinstance(c, torch.Tensor):
                c.fill_(n)

    def warmed(fn, argv, calls, before, **kw):
        """fn compiled (fullgraph, the gpt-fast recipe; where this transformers/PyTorch pair breaks the graph,
        with the breaks allowed; else eager, said so) and called `calls` times: (callable, seconds, how)."""
        tries = [] if args.no_compile else [("fullgraph", dict(fullgraph=True, **kw)), ("graph breaks", dict(kw))]
        for how, opts in tries + [("eager", None)]:
            f = fn if opts is None else torch.compile(fn, **opts)
            t0 = time.time()
            try:
                for _ in range(calls):
                    before()
                    f(*argv)
                torch.cuda.synchronize()
                return f, time.time() - t0, how
            except Exception as e:  # noqa: BLE001  (a compiler failure: try the next way, say why)
                first = (str(e).strip().splitlines() or [""])[0][:200]
                print(f"  note: torch.compile as {how} failed: {type(e).__name__}: {first}", flush=True)
                torch._dynamo.reset()
        raise RuntimeError("the eager call failed too")

    with torch.inference_mode():
        for pair in filter(None, args.decode.split(",")):
            bsz, ctx = (int(x) for x in pair.split("x"))
            cache = make_cache(bsz, ctx)
            ids = torch.randint(0, args.vocab, (bsz, 1), device=dev)
            pos = torch.full((bsz, 1), ctx - 1, device=dev, dtype=torch.long)
            cpos = torch.tensor([ctx - 1], device=dev, dtype=torch.long)
            # the context's keys and values: one prefill of ctx - 1 random tokens into the cache (eager)
            model(input_ids=torch.randint(0, args.vocab, (bsz, ctx - 1), device=dev), past_key_values=cache,
                  cache_position=torch.arange(ctx - 1, device=dev), use_cache=True, logits_to_keep=1)

            def step(ids, pos, cpos):
                return model(input_ids=ids, position_ids=pos, cache_position=cpos, past_key_values=cache,
                             use_cache=True).logits

            # a kernel a layer before each step, outside the compiled graph: under 1% of a step's time
            back = lambda: rewind(cache, ctx - 1)  # noqa: E731
            fn, warm, how = warmed(step, (ids, pos, cpos), 3, back, mode="reduce-overhead")
            t = timed(lambda: (back(), fn(ids, pos, cpos)))
            print(f"  peer decode  batch {bsz:3d} ctx {ctx:5d}  {t[0]:9.3f} ms ({t[1]:.3f}-{t[2]:.3f})  "
                  f"[{how}, warm-up {warm:.0f} s]", flush=True)
            del cache, fn
            torch.cuda.empty_cache()
        if args.prefill:
            n = args.prefill
            cache = make_cache(1, n)
            ids = torch.randint(0, args.vocab, (1, n), device=dev)
            cpos = torch.arange(n, device=dev)

            def prefill(ids, cpos):
                return model(input_ids=ids, cache_position=cpos, past_key_values=cache, use_cache=True,
                             logits_to_keep=1).logits

            back = lambda: rewind(cache, 0)  # noqa: E731
            fn, warm, how = warmed(prefill, (ids, cpos), 2, back)
            t = timed(lambda: (back(), fn(ids, cpos)))
            print(f"  peer prefill {n:5d} tokens  {t[0]:9.3f} ms ({t[1]:.3f}-{t[2]:.3f})  [{how}, warm-up {warm:.0f} s]",
                  flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001  (kvbank-bench keeps stdout: the cause must be there, not only on stderr)
        import traceback
        print("peer error:\n" + traceback.format_exc(), flush=True)
        sys.exit(1)
