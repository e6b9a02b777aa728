"""Our sampler against transformers' generate, and its stopping rules."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cory_lora.config import GenerationConfig
from cory_lora.engine.generation import Stopping, cut_at_stop, generate, sample
from cory_lora.engine.model import load_agents
from cory_lora.errors import UserError

from .helpers import ROOT

PROMPTS = ["1+2=", "40+33=", "hello there, ", "7", "12+9=21;12+9="]


@pytest.fixture(scope="module")
def agents(tiny_model_dir, arith_file):
    from cory_lora.config import recipe_from_dict

    from .conftest import tiny_recipe_dict

    agents = load_agents(recipe_from_dict(tiny_recipe_dict(tiny_model_dir, arith_file)))
    with torch.no_grad():  # make llm1 differ from the base so the adapter matters
        for name, p in agents.model.named_parameters():
            if "lora_B.llm1" in name:
                p.normal_(0, 0.5)
    return agents


def hf_greedy(model, tokenizer, prompts, max_new_tokens, **kwargs):
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(
        **batch,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        **kwargs,
    )
    return out[:, batch.input_ids.shape[1] :]


def ours(model, tokenizer, prompts, seed=0, stopping=None, **cfg):
    ids = [tokenizer(p).input_ids for p in prompts]
    stopping = stopping or Stopping((tokenizer.eos_token_id,))
    return generate(
        model,
        tokenizer,
        ids,
        GenerationConfig(**cfg),
        stopping,
        torch.Generator().manual_seed(seed),
    )


def same_tokens(a: torch.Tensor, b: torch.Tensor, pad_id: int) -> bool:
    width = max(a.shape[1], b.shape[1])
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=pad_id)  # noqa: E731
    return torch.equal(pad(a), pad(b))


def greedy_equals_generate(model, tokenizer, prompts, max_new_tokens) -> torch.Tensor:
    """Assert our greedy tokens equal `generate`'s for `prompts`; return generate's tokens.
    Micro-batches of 2 also exercise stitching uneven chunks back together."""
    expected = hf_greedy(model, tokenizer, prompts, max_new_tokens)
    got = ours(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=0.0, batch_size=2
    )
    assert same_tokens(
        got.response_ids * got.response_mask,
        expected * (expected != tokenizer.pad_token_id),
        tokenizer.pad_token_id,
    )
    return expected


def test_greedy_equals_transformers_generate_with_left_padding_and_an_active_adapter(agents):
    tok = agents.tokenizer
    with agents.use("llm1"):
        expected = greedy_equals_generate(agents.model, tok, PROMPTS, 12)
    with agents.reference():
        base_expected = hf_greedy(agents.model, tok, PROMPTS, 12)
    assert not torch.equal(base_expected, expected), "the adapter should change the greedy output"


def test_greedy_with_repetition_penalty_equals_transformers(agents):
    tok = agents.tokenizer
    prompts = ["ab+ab+ab"]  # no padding: transformers also penalises pad tokens
    with agents.use("llm1"):
        expected = hf_greedy(agents.model, tok, prompts, 10, repetition_penalty=1.5)
        got = ours(
            agents.model, tok, prompts, max_new_tokens=10, temperature=0.0, repetition_penalty=1.5
        )
    assert same_tokens(got.response_ids, expected, tok.pad_token_id)


def test_rows_do_not_depend_on_batch_company(agents):
    tok = agents.tokenizer
    with agents.use("llm1"):
        batched = ours(agents.model, tok, PROMPTS, max_new_tokens=8, temperature=0.0)
        for i, p in enumerate(PROMPTS):
            alone = ours(agents.model, tok, [p], max_new_tokens=8, temperature=0.0)
            assert batched.texts[i] == alone.texts[0]


def test_sampling_is_seeded_and_top_k_1_is_greedy(agents):
    tok, m = agents.tokenizer, agents.model
    a = ours(m, tok, PROMPTS * 4, seed=1, max_new_tokens=8)
    b = ours(m, tok, PROMPTS * 4, seed=1, max_new_tokens=8)
    c = ours(m, tok, PROMPTS * 4, seed=2, max_new_tokens=8)
    assert a.texts == b.texts and a.texts != c.texts
    greedy = ours(m, tok, PROMPTS, max_new_tokens=8, temperature=0.0)
    top1 = ours(m, tok, PROMPTS, seed=3, max_new_tokens=8, top_k=1, top_p=0.5, temperature=0.7)
    assert top1.texts == greedy.texts


@pytest.fixture(scope="module")
def arith_model():
    path = ROOT / "assets" / "tiny-arith"
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_stop_strings_end_rows_independently(arith_model):
    model, tok = arith_model
    stop = Stopping((tok.eos_token_id,), (";",))
    prompts = ["1+2=", "12+9=21;12+9=", "3+4=7;3+"]
    got = ours(model, tok, prompts, stopping=stop, max_new_tokens=10, temperature=0.0, stop=(";",))
    lengths = got.response_mask.sum(1).tolist()
    for i, text in enumerate(got.texts):
        assert ";" not in text
        decoded = tok.decode(got.response_ids[i, : lengths[i]])
        assert decoded.endswith(";"), "the stop token stays in the response (it is trained on)"
        assert (got.response_ids[i, lengths[i] :] == tok.pad_token_id).all()
    assert len(set(lengths)) > 1 and max(lengths) < 10


def test_min_new_tokens_blocks_eos(arith_model):
    model, tok = arith_model
    semicolon = tok.convert_tokens_to_ids(";")
    stop = Stopping((semicolon,))
    early = ours(model, tok, ["1+2=3;1+2="] * 4, stopping=stop, max_new_tokens=8, temperature=0.0)
    late = ours(
        model,
        tok,
        ["1+2=3;1+2="] * 4,
        stopping=stop,
        max_new_tokens=8,
        temperature=0.0,
        min_new_tokens=4,
    )
    assert early.response_mask.sum(1).max() < 4
    assert (late.response_mask.sum(1) >= 4).all()


def test_cut_at_stop():
    assert cut_at_stop("19;2+2", (";",)) == "19"
    assert cut_at_stop("a\n\nb;", (";", "\n\n")) == "a"
    assert cut_at_stop("abc", ()) == "abc"


def test_sampling_draws_each_token_with_its_softmax_probability():
    """The inverse-CDF draw against hand-worked probabilities: softmax([0, ln 2, -inf, ln 3, -inf])
    = [1/6, 2/6, 0, 3/6, 0]. 60,000 draws per row put each frequency within 0.01 (over 5 standard
    errors), and masked (-inf) entries, including the last one, are never drawn."""
    logits = torch.tensor([[1.0, 2.0, 0.0, 3.0, 0.0]]).log().repeat(60_000, 1)
    drawn = sample(logits, torch.Generator().manual_seed(0))
    frequencies = torch.bincount(drawn, minlength=5) / len(drawn)
    assert torch.allclose(frequencies, torch.tensor([1 / 6, 2 / 6, 0, 3 / 6, 0]), atol=0.01)
    assert (
        sample(logits[:3], torch.Generator().manual_seed(5)).tolist()
        == sample(logits[:3], torch.Generator().manual_seed(5)).tolist()
    )


def test_sampling_refuses_probabilities_that_overflowed():
    for bad in (float("nan"), float("inf")):
        logits = torch.zeros(2, 4)
        logits[1, 2] = bad
        with pytest.raises(UserError, match="NaN/inf"):
            sample(logits, torch.Generator().manual_seed(0))
    with pytest.raises(UserError, match="NaN/inf"):
        sample(torch.full((1, 4), float("-inf")), torch.Generator().manual_seed(0))
