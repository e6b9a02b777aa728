"""How close each phase of training runs to this machine's limits, on the real model.

    python bench/limits.py                         # SmolLM2-135M (fetched:smollm2), CPU
    python bench/limits.py --quick                 # fewer repeats, smaller limits probes
    python bench/limits.py --model DIR --device cuda

First the machine: matrix-multiply throughput (2048 x 2048, float32 and bfloat16) and memory
bandwidth (a 256 MiB copy: bytes read + written per second), measured with torch. Then each
phase of a training iteration, run through cory-lora's own model (`load_agents` on
recipes/smollm2_sentiment.toml, LoRA on, the recipe's micro-batch and lengths), in float32,
bfloat16 and 4-bit:

* decode: one sampling step of a batch (`--batch` rows, a KV cache of the prompt length): the
  step must read every weight once, so its limit is weight bytes / bandwidth (or its FLOPs /
  matmul peak, whichever is longer);
* score: a no-grad forward over micro-batch x (prompt + response) tokens, logits at the response
  positions only (what rollout scoring does);
* update: the same forward with gradients through the LoRA adapters, and its backward.

For each: the time (median of --repeats), the FLOPs it must do (2 x weights x tokens forward,
2x that again backward for the activations' gradients; the LM head only at the kept positions),
the bytes it must read (the weights), the time the limits allow (the larger of FLOPs / peak and
bytes / bandwidth for the phase's dtype) and the fraction of it achieved: limit / measured. A
4-bit base is dequantised on the fly: its limit is taken at the bfloat16 matmul peak and its
packed bytes, which no CPU kernel reaches; the column says how far from it we are, not that it
is reachable.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cory_lora.config import load_recipe
from cory_lora.engine.model import load_agents

RECIPE = "recipes/smollm2_sentiment.toml"


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: allocator, kernels, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine_limits(device: str, repeats: int, quick: bool) -> dict[str, float]:
    """Matmul FLOP/s per dtype and memory bytes/s, measured."""
    n = 1024 if quick else 2048
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        out[str(dtype)] = 2 * n**3 / timed(lambda a=a, b=b: a @ b, repeats)
    x = torch.empty((64 if quick else 256) << 20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    out["bytes/s"] = 2 * x.numel() / timed(lambda: y.copy_(x), repeats)
    return out


def weight_counts(agents) -> tuple[int, int, int]:
    """(parameters of the decoder's linear layers, hidden size, vocabulary): what each token's
    forward multiplies by, the LM head apart."""
    config = agents.model.config
    layers = sum(  # nn.Linear only: PEFT's wrappers repeat their base layer's in/out features
        m.in_features * m.out_features
        for name, m in agents.model.named_modules()
        if isinstance(m, torch.nn.Linear) and "lora_" not in name and "lm_head" not in name
    )
    return layers, config.hidden_size, config.vocab_size


def phases(recipe, batch: int, repeats: int) -> tuple[dict[str, tuple[float, float]], int]:
    """Per phase (seconds, FLOPs) on the model of `recipe`, and its weights' bytes."""
    agents = load_agents(recipe)
    layers, hidden, vocab = weight_counts(agents)
    prompt, new = recipe.data.max_prompt_tokens, recipe.generation.max_new_tokens
    rows, device = recipe.ppo.micro_batch_size, agents.device
    ids = torch.randint(100, vocab - 100, (rows, prompt + new), device=device)
    mask = torch.ones_like(ids)
    out = {}
    with agents.use("llm1"):
        cache_ids = torch.randint(100, vocab - 100, (batch, prompt), device=device)
        with torch.no_grad():
            past = agents.model(input_ids=cache_ids, use_cache=True).past_key_values
        step = cache_ids[:, -1:]

        def decode():
            with torch.no_grad():
                agents.model(input_ids=step, past_key_values=past, use_cache=True)
            past.crop(-1)  # back to the prompt's length: every step sees the same cache

        flops = 2 * (layers + hidden * vocab) * batch
        out["decode"] = (timed(decode, repeats), flops)

        def score():
            with torch.no_grad():
                agents.forward(ids, mask, new + 1)

        tokens = rows * (prompt + new)
        forward = 2 * layers * tokens + 2 * hidden * vocab * rows * (new + 1)
        out["score"] = (timed(score, repeats), forward)

        def update():
            agents.model.train()
            logits, _ = agents.forward(ids, mask, new + 1)
            logits.float().log_softmax(-1).mean().backward()
            agents.model.zero_grad(set_to_none=True)
            agents.model.eval()

        out["update"] = (timed(update, repeats), 3 * forward)
    weight_bytes = sum(
        p.numel() * p.element_size() for n, p in agents.model.named_parameters() if "lora_" not in n
    )
    return out, weight_bytes


def quiet() -> None:
    """Loading progress bars and deprecation warnings would bury the table."""
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")


def main() -> None:
    quiet()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="fetched:smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=16, help="rows of a decode step")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 repeats, smaller probes")
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    limits = machine_limits(args.device, repeats, args.quick)
    print(
        f"machine: matmul {limits['torch.float32'] / 1e9:,.0f} GFLOP/s float32, "
        f"{limits['torch.bfloat16'] / 1e9:,.0f} GFLOP/s bfloat16; "
        f"memory {limits['bytes/s'] / 1e9:.1f} GB/s ({torch.get_num_threads()} threads)"
    )
    print(f"model {args.model}; decode batch {args.batch}; {RECIPE}'s micro-batch and lengths")
    print(
        f"{'weights':<9} {'phase':<7} {'ms':>8} {'GFLOP/s':>9} {'GB/s':>6} "
        f"{'limit ms':>9} {'of limit':>9}"
    )
    for name, sets in (
        ("float32", ['model.dtype="float32"', "model.load_in_4bit=false"]),
        ("bfloat16", ['model.dtype="bfloat16"', "model.load_in_4bit=false"]),
        ("4-bit", ['model.dtype="bfloat16"', "model.load_in_4bit=true"]),
    ):
        where = [f'model.name_or_path="{args.model}"', f'model.device="{args.device}"']
        recipe = load_recipe(RECIPE, [*where, *sets])
        measured, weight_bytes = phases(recipe, args.batch, repeats)
        peak = limits["torch.float32" if name == "float32" else "torch.bfloat16"]
        for phase, (seconds, flops) in measured.items():
            passes = 3 if phase == "update" else 1  # the backward reads the weights twice
            limit = max(flops / peak, passes * weight_bytes / limits["bytes/s"])
            print(
                f"{name:<9} {phase:<7} {seconds * 1e3:>8.1f} {flops / seconds / 1e9:>9.1f} "
                f"{passes * weight_bytes / seconds / 1e9:>6.1f} {limit * 1e3:>9.1f} "
                f"{limit / seconds:>8.0%}"
            )


if __name__ == "__main__":
    main()
