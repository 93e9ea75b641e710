"""``python -m dflash_jax.generate``: load a checkpoint and generate, from the command line.

    python -m dflash_jax.generate --model tests/fixtures/qwen36_tiny_a --prompt-ids 1,2,3 --max-tokens 16
    python -m dflash_jax.generate --model PATH --prompt "def fib(n):"      # needs tokenizer.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from dflash_jax.engine.loop import Engine, RequestError, SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_jax.generate", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint directory (Qwen3.5/3.6 hybrid)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch); needs tokenizer.json")
    src.add_argument("--prompt-ids", action="append", help="comma-separated token ids (repeat for a batch)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--json", action="store_true", help="print one JSON object per request")
    args = ap.parse_args(argv)

    if args.prompt_ids:
        try:
            prompts = [[int(t) for t in p.split(",") if t.strip()] for p in args.prompt_ids]
        except ValueError:
            ap.error("--prompt-ids takes comma-separated integers, e.g. --prompt-ids 1,2,3")
    else:
        prompts = args.prompt
    t0 = time.perf_counter()
    eng = Engine.from_pretrained(args.model, dtype=args.dtype, max_batch=max(1, len(prompts)),
                                 max_model_len=args.max_model_len, warmup=False)
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, min_p=args.min_p, seed=args.seed)
    try:
        outs = eng.generate(prompts, sp)
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for o in outs:
        if args.json:
            print(json.dumps({"token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason,
                              "stats": o.stats}))
        else:
            print(o.text if o.text is not None else " ".join(map(str, o.token_ids)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
