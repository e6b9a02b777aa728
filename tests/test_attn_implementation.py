"""model.attn_implementation: validated in the recipe, passed to from_pretrained, and refused
early (before any weights load) where it cannot run."""

from __future__ import annotations

import pytest
import torch

from cory_lora.engine.model import load_base_model
from cory_lora.errors import ConfigError, UserError


def test_default_is_sdpa_and_it_reaches_the_model(tiny_recipe):
    recipe = tiny_recipe()
    assert recipe.model.attn_implementation == "sdpa"
    assert load_base_model(recipe.model).config._attn_implementation == "sdpa"


def test_eager_is_passed_to_from_pretrained_and_agrees_with_sdpa(tiny_recipe):
    eager = load_base_model(tiny_recipe(model={"attn_implementation": "eager"}).model)
    sdpa = load_base_model(tiny_recipe().model)
    assert eager.config._attn_implementation == "eager"
    ids = torch.tensor([[1, 20, 30, 40, 50], [0, 0, 1, 25, 35]])
    mask = (ids != 0).long()
    with torch.no_grad():
        a = eager(input_ids=ids, attention_mask=mask).logits
        b = sdpa(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()  # padded positions are garbage in both
    torch.testing.assert_close(a[keep], b[keep], atol=1e-5, rtol=1e-5)


def test_an_unknown_kernel_is_a_recipe_error(tiny_recipe):
    with pytest.raises(ConfigError, match=r"model.attn_implementation = \"flash\": must be one"):
        tiny_recipe(model={"attn_implementation": "flash"})


def test_flash_attention_on_cpu_is_refused_before_loading(tiny_recipe):
    recipe = tiny_recipe(model={"attn_implementation": "flash_attention_2"})
    with pytest.raises(UserError, match="flash_attention_2' needs a CUDA GPU"):
        load_base_model(recipe.model)
