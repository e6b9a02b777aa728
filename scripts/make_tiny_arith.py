"""Build the offline demo: a tiny Llama that half-knows two-digit addition, and its prompts.

    python scripts/make_tiny_arith.py            # writes assets/tiny-arith and assets/arith

The model is pretrained (plain next-token prediction) on chains of equations such as
`12+7=19;12+7=19;40+33=73`, where an equation is often repeated, so it learns both some
arithmetic and to copy an answer it has just read. Pretraining stops early on purpose: sampled
at temperature 1 the model answers only part of the problems right, which leaves room for RL to
improve it, and an observer that reads the pioneer's answer can profit by copying a right one.

Deterministic for a given seed on CPU. Takes about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from cory_lora.engine.tiny import char_tokenizer, tiny_llama_config

MAX_OPERAND = 49


def equation(a: int, b: int) -> str:
    return f"{a}+{b}={a + b}"


def chain(rng: random.Random, n: int = 8) -> str:
    """Equations joined by ';', each repeated with probability 0.4 (teaches copying)."""
    parts: list[str] = []
    while len(parts) < n:
        eq = equation(rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND))
        parts.append(eq)
        if rng.random() < 0.4:
            parts.append(eq)
    return ";".join(parts) + ";"


def write_prompts(out: Path, seed: int) -> None:
    """All a+b problems, split 90/10 into train and test, in a GSM8K-like question/answer schema."""
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(seed).shuffle(pairs)
    n_test = len(pairs) // 10
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in (("test", pairs[:n_test]), ("train", pairs[n_test:])):
        with open(out / f"{split}.jsonl", "w") as f:
            for a, b in rows:
                f.write(json.dumps({"question": f"{a}+{b}=", "answer": str(a + b)}) + "\n")


@torch.no_grad()
def accuracy(model, tokenizer, rng: random.Random, greedy: bool, n: int = 300) -> float:
    correct = 0
    for _ in range(n):
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        ids = tokenizer(f"{a}+{b}=", return_tensors="pt").input_ids
        out = model.generate(
            ids,
            max_new_tokens=4,
            do_sample=not greedy,
            top_k=0,
            pad_token_id=0,
            eos_token_id=tokenizer.convert_tokens_to_ids(";"),
        )
        text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        correct += text.split(";")[0] == str(a + b)
    return correct / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="assets")
    parser.add_argument("--max-steps", type=int, default=1500)
    parser.add_argument(
        "--stop-at", type=float, default=0.3, help="stop once sampled accuracy reaches this"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = char_tokenizer()
    model = LlamaForCausalLM(tiny_llama_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))
    for step in range(1, args.max_steps + 1):
        batch = tokenizer([chain(rng) for _ in range(64)], return_tensors="pt", padding=True)
        labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 25 == 0:
            # Accuracy jumps within ~100 steps (a phase change), so check often and stop early.
            model.eval()
            sampled = accuracy(model, tokenizer, random.Random(1), greedy=False, n=200)
            model.train()
            print(f"step {step:5d}  loss {loss.item():.3f}  sampled accuracy {sampled:.2f}")
            if sampled >= args.stop_at:
                break
    model.eval()
    greedy = accuracy(model, tokenizer, random.Random(2), greedy=True)
    sampled = accuracy(model, tokenizer, random.Random(2), greedy=False)
    print(f"final: greedy accuracy {greedy:.2f}, sampled accuracy {sampled:.2f}")
    model.save_pretrained(Path(args.out) / "tiny-arith")
    tokenizer.save_pretrained(Path(args.out) / "tiny-arith")
    write_prompts(Path(args.out) / "arith", args.seed)


if __name__ == "__main__":
    main()
