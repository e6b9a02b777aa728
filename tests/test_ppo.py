"""PPO maths against values worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from cory_lora.algorithm import ppo


def close(a, b, tol=1e-5):
    return torch.allclose(
        torch.as_tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32), atol=tol
    )


def test_gae_single_row():
    # gamma 1, lambda 0.95; deltas: t2 = 1 - 0.7 = 0.3, t1 = 0.7 - 0.6 = 0.1, t0 = 0.6 - 0.5 = 0.1
    # A2 = 0.3; A1 = 0.1 + 0.95 * 0.3 = 0.385; A0 = 0.1 + 0.95 * 0.385 = 0.46575
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = ppo.gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=0.95)
    assert close(adv, [[0.46575, 0.385, 0.3]])
    assert close(ret, [[0.96575, 0.985, 1.0]])


def test_gae_ignores_padding_and_bootstraps_zero_after_the_last_token():
    # gamma 0.9, lambda 0.5; the padded value 9.0 must not leak in.
    # t1: delta = 1.0 + 0.9 * 0 - 0.4 = 0.6 -> A1 = 0.6
    # t0: delta = 0.2 + 0.9 * 0.4 - 0.1 = 0.46 -> A0 = 0.46 + 0.45 * 0.6 = 0.73
    rewards = torch.tensor([[0.2, 1.0, 0.0]])
    values = torch.tensor([[0.1, 0.4, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, ret = ppo.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    assert close(adv, [[0.73, 0.6, 0.0]])
    assert close(ret, [[0.83, 1.0, 0.0]])


def test_token_rewards_put_the_score_on_the_last_real_token():
    # row 0: -0.5 * [0.1, 0.2, 0.3] + [0, 0, 2]; row 1: -0.5 * [0.5, 0.5] + [0, -1], pad 0
    scores = torch.tensor([2.0, -1.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards = ppo.token_rewards(scores, kl, 0.5, mask)
    assert close(rewards, [[-0.05, -0.1, 1.85], [-0.25, -1.25, 0.0]])


def test_kl_estimators():
    # p = 0.5, p_ref = 0.25: k1 = log 2; k3 = (r - 1) - log r with r = 0.5 -> -0.5 + log 2
    lp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    assert close(ppo.kl_per_token(lp, ref, "k1"), [[math.log(2)]])
    assert close(ppo.kl_per_token(lp, ref, "k3"), [[-0.5 + math.log(2)]])
    # k3 is never negative, k1 can be
    assert ppo.kl_per_token(ref, lp, "k1").item() < 0 < ppo.kl_per_token(ref, lp, "k3").item()
    with pytest.raises(ValueError):
        ppo.kl_per_token(lp, ref, "k2")


def test_full_kl():
    # p = [.5, .5], q = [.25, .75]: .5 log 2 + .5 log(2/3) = 0.143841
    p = torch.tensor([[[0.5, 0.5]]]).log()
    q = torch.tensor([[[0.25, 0.75]]]).log()
    assert close(ppo.full_kl(p, q), [[0.5 * math.log(2) + 0.5 * math.log(2 / 3)]])
    assert close(ppo.full_kl(p, p), [[0.0]])


def test_masked_whiten():
    # masked-in [1, 2, 3]: mean 2, unbiased var 1 -> [-1, 0, 1]; the masked 100 is ignored
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert close(ppo.masked_whiten(x, mask), [-1.0, 0.0, 1.0, 0.0], tol=1e-4)
    assert close(ppo.masked_whiten(x, mask, shift_mean=False), [1.0, 2.0, 3.0, 0.0], tol=1e-4)
    assert close(ppo.masked_mean(x, mask), 2.0)
    assert close(ppo.masked_var(x, mask), 1.0)


def test_policy_loss_clips_both_ways():
    # token 0: A = 1, r = 1.5 -> max(-1.5, -1.2) = -1.2 (clipped); token 1: A = -1, r = 0.5
    # -> max(0.5, 0.8) = 0.8 (clipped). loss = (-1.2 + 0.8) / 2 = -0.2
    old = torch.tensor([[-1.0, -2.0]])
    new = old + torch.tensor([[math.log(1.5), math.log(0.5)]])
    out = ppo.policy_loss(new, old, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), 0.2, n_tokens=2)
    assert close(out.loss, -0.2)
    assert out.clipped_tokens.item() == 2
    assert close(out.approx_kl_sum, 0.5 * math.log(1.5) ** 2 + 0.5 * math.log(0.5) ** 2)


def test_policy_loss_at_ratio_one_is_minus_mean_advantage():
    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    adv = torch.tensor([[1.0, 2.0, 6.0]])
    out = ppo.policy_loss(lp, lp, adv, torch.tensor([[1.0, 1.0, 0.0]]), 0.2, n_tokens=2)
    assert close(out.loss, -1.5)  # -(1 + 2) / 2; the masked token is ignored
    assert out.clipped_tokens.item() == 0


def test_value_loss():
    # token 0: max((1 - 2)^2, (0.7 - 2)^2) = 1.69; token 1: max(0, 0.3^2) = 0.09
    # loss = 0.5 * (1.69 + 0.09) / 2 = 0.445
    loss = ppo.value_loss(
        torch.tensor([[1.0, 0.0]]),
        torch.tensor([[0.5, 0.5]]),
        torch.tensor([[2.0, 0.0]]),
        torch.ones(1, 2),
        0.2,
        n_tokens=2,
    )
    assert close(loss, 0.445)


def test_gradient_accumulation_1x8_equals_8x1():
    torch.manual_seed(0)
    weight = torch.randn(5, requires_grad=True)
    feats = torch.randn(8, 6, 5)
    old = torch.randn(8, 6) * 0.1
    adv, ret, old_v = torch.randn(8, 6), torch.randn(8, 6), torch.randn(8, 6)
    mask = (torch.rand(8, 6) > 0.3).float()
    n_tokens = mask.sum()

    def loss(rows):
        out = feats[rows] @ weight
        pg = ppo.policy_loss(out * 0.1, old[rows], adv[rows], mask[rows], 0.2, n_tokens).loss
        return pg + 0.1 * ppo.value_loss(out, old_v[rows], ret[rows], mask[rows], 0.2, n_tokens)

    loss(torch.arange(8)).backward()
    whole = weight.grad.clone()
    weight.grad = None
    for i in range(8):
        loss(torch.tensor([i])).backward()
    assert torch.allclose(weight.grad, whole, atol=1e-6)


def test_adaptive_kl_controller():
    # err = clip(12 / 6 - 1, +-0.2) = 0.2 -> beta = 0.2 * (1 + 0.2 * 256 / 10000)
    ctl = ppo.KLController(0.2, adaptive=True, target=6.0, horizon=10000)
    ctl.update(12.0, 256)
    assert math.isclose(ctl.value, 0.2 * 1.00512)
    # err = clip(3 / 6 - 1, +-0.2) = -0.2 -> times (1 - 0.2 * 100 / 10000)
    ctl.update(3.0, 100)
    assert math.isclose(ctl.value, 0.2 * 1.00512 * 0.998)
    fixed = ppo.KLController(0.2, adaptive=False, target=6.0, horizon=10000)
    fixed.update(100.0, 256)
    assert fixed.value == 0.2


def test_running_moments_match_the_whole_sample():
    moments = ppo.RunningMoments()
    moments.update(torch.tensor([1.0, 2.0, 3.0]))
    moments.update(torch.tensor([4.0, 5.0]))
    assert math.isclose(moments.mean, 3.0, abs_tol=1e-9)
    assert math.isclose(moments.std, math.sqrt(2.5), rel_tol=1e-9)  # sample std of 1..5


def test_score_scaling_and_clipping():
    # running mean 2 and std 1 after [1, 2, 3]
    assert close(
        ppo.normalise_scores(torch.tensor([1.0, 2.0, 3.0]), ppo.RunningMoments(), False, 0.0),
        [1.0, 2.0, 3.0],
    )
    normed = ppo.normalise_scores(torch.tensor([1.0, 2.0, 3.0]), ppo.RunningMoments(), True, 0.5)
    assert close(normed, [-0.5, 0.0, 0.5])
    assert close(ppo.normalise_scores(torch.tensor([3.0, -4.0]), None, False, 1.0), [1.0, -1.0])


def test_score_scaling_puts_the_collective_reward_on_the_single_reward_scale():
    # The fair β of the SmolLM2 recipes: a CORY agent is paid r_own + r_other, whose spread is
    # up to twice a PPO agent's r_own; scaled by their own running std, both land on one scale.
    # PPO's scores [0, 1]: mean 0.5, sample std sqrt(0.5) -> [0, 1 / sqrt(0.5)] = [0, 1.4142];
    # CORY's [0, 2]: mean 1, sample std sqrt(2) -> [0, 2 / sqrt(2)] = [0, 1.4142]; with the
    # running mean subtracted (score_norm), both are [-0.7071, 0.7071].
    for norm, expected in ((False, [0.0, math.sqrt(2)]), (True, [-(0.5**0.5), 0.5**0.5])):
        single = ppo.normalise_scores(torch.tensor([0.0, 1.0]), ppo.RunningMoments(), norm, 0.0)
        collective = ppo.normalise_scores(torch.tensor([0.0, 2.0]), ppo.RunningMoments(), norm, 0.0)
        assert close(single, expected) and close(collective, expected)


def test_selective_logprobs_equal_the_naive_log_softmax_gather():
    torch.manual_seed(0)
    logits, tokens = torch.randn(3, 5, 40) * 4, torch.randint(0, 40, (3, 5))
    for temperature in (1.0, 0.7):
        naive = (logits / temperature).log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
        assert torch.allclose(ppo.selective_logprobs(logits, tokens, temperature), naive, atol=1e-6)
    # hand-worked: logits [0, log 3] -> probabilities 1/4, 3/4
    two = torch.tensor([[[0.0, math.log(3.0)]]])
    assert close(ppo.selective_logprobs(two, torch.tensor([[1]])), [[math.log(0.75)]])


def test_selective_logprobs_are_computed_in_float32_from_bf16_logits():
    torch.manual_seed(0)
    logits = (torch.randn(2, 4, 1000) * 20).bfloat16()
    tokens = torch.randint(0, 1000, (2, 4))
    got = ppo.selective_logprobs(logits, tokens)
    assert got.dtype == torch.float32
    naive = logits.float().log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    assert torch.allclose(got, naive, atol=1e-5)


def test_entropy_equals_the_naive_formula():
    torch.manual_seed(0)
    logits = torch.randn(2, 300, 50)  # more rows than one chunk
    p = logits.softmax(-1)
    assert torch.allclose(ppo.entropy(logits), -(p * p.log()).sum(-1), atol=1e-5)
    # hand-worked: a uniform distribution over 4 tokens has entropy log 4
    assert close(ppo.entropy(torch.zeros(1, 4)), [math.log(4.0)])


def test_nothing_imports_trl_trainer_utilities():
    """TRL's logprob/entropy helpers dispatch to Triton kernels on CUDA: we keep our own."""
    from .helpers import ROOT

    sources = [p.read_text() for p in (ROOT / "cory_lora").rglob("*.py")]
    assert not any("trl.trainer" in text for text in sources)
