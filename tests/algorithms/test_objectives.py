"""The matching objectives (algorithms/objectives.py) against hand computations on small tensors, and their limits."""

import pytest
import torch

from ddpo_group.algorithms import flow_forward, get_objective, optimality_probability, register_objective
from ddpo_group.algorithms.objectives import OBJECTIVE_REGISTRY

# two pairs, latents of 2 values each
U = torch.tensor([[1.0, -1.0], [0.5, 0.5]])  # targets eps - x_clean
V = torch.tensor([[0.0, 0.0], [1.0, 0.0]])  # policy velocities
V_OLD = torch.tensor([[0.5, -0.5], [0.5, 0.0]])
SIGMA = torch.tensor([0.5, 0.25])


def test_flow_forward_by_hand():
    x_clean, eps = torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 4.0]])
    x_s, u = flow_forward(x_clean, eps, torch.tensor([0.25]))
    assert x_s.tolist() == [[1.5, 1.0]]  # 0.75 x_clean + 0.25 eps
    assert u.tolist() == [[-2.0, 4.0]]


def test_registry_and_kinds():
    assert get_objective("policy_gradient").kind == "policy_gradient"
    assert get_objective("awm").is_matching and not get_objective("awm").needs_old_model
    assert get_objective("nft").needs_old_model
    with pytest.raises(ValueError, match="unknown objective 'nope'"):
        get_objective("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_objective("awm")(lambda *a, **k: None)
    assert "nft" in OBJECTIVE_REGISTRY


def test_awm_by_hand():
    a = torch.tensor([2.0, -1.0])
    loss, info = get_objective("awm")(V, U, a, SIGMA)
    # errors: mean((0-1)^2, (0+1)^2) = 1; mean((1-0.5)^2, (0-0.5)^2) = 0.25
    assert torch.allclose(loss, torch.tensor([2.0, -0.25]))
    assert float(info["matching_error"]) == pytest.approx(0.625)
    loss_t, _ = get_objective("awm")(V, U, a, SIGMA, weighting="t")
    assert torch.allclose(loss_t, torch.tensor([1.0, -0.0625]))
    # ghuber, p = 0.5: s (sqrt(l + 1e-10) - 1e-5) / 0.5: pair 0: 0.5 (1 - 1e-5) / 0.5; pair 1: 0.25 (0.5 - 1e-5) / 0.5
    loss_g, _ = get_objective("awm")(V, U, a, SIGMA, weighting="ghuber", ghuber_power=0.5)
    assert torch.allclose(loss_g, torch.tensor([2 * (1 - 1e-5), -(0.5 - 1e-5) / 2]), atol=1e-6)


def test_awm_zero_advantage_zero_gradient():
    v = V.clone().requires_grad_(True)
    loss, _ = get_objective("awm")(v, U, torch.zeros(2), SIGMA)
    loss.sum().backward()
    assert torch.equal(v.grad, torch.zeros_like(v))


def test_sft_by_hand():
    v = V.clone().requires_grad_(True)
    # errors 1 and 0.25 (test_awm_by_hand); advantages 2 (kept) and -1 (left out at min_advantage 0)
    loss, info = get_objective("sft")(v, U, torch.tensor([2.0, -1.0]), SIGMA)
    assert loss.tolist() == [1.0, 0.0] and float(info["kept"]) == 0.5 and float(info["matching_error"]) == 1.0
    loss.sum().backward()  # d/dv mean (v - u)^2 = (v - u): the kept pair only, whatever its advantage's size
    assert v.grad.tolist() == [[-1.0, 1.0], [0.0, 0.0]]
    loss, info = get_objective("sft")(V, U, torch.tensor([2.0, -1.0]), SIGMA, min_advantage=-2.0)
    assert loss.tolist() == [1.0, 0.25] and float(info["kept"]) == 1.0
    assert get_objective("sft").config_errors({"min_advantage": "high"}) and not get_objective("sft").config_errors({})


def test_optimality_probability():
    r = optimality_probability(torch.tensor([-10.0, -2.5, 0.0, 5.0]), adv_clip_max=5.0)
    assert r.tolist() == [0.0, 0.25, 0.5, 1.0]


def test_nft_by_hand_without_adaptive_weight():
    a = torch.tensor([2.5, -5.0])  # r = 0.75, 0
    beta = 0.5
    loss, info = get_objective("nft")(V, U, a, SIGMA, old_pred=V_OLD, adv_clip_max=5.0, beta=beta,
                                      adaptive_weight=False)
    pos = (1 - beta) * V_OLD + beta * V  # [[0.25, -0.25], [0.75, 0]]
    neg = (1 + beta) * V_OLD - beta * V  # [[0.75, -0.75], [0.25, 0]]
    # pair 0: pos err mean(0.75^2, 0.75^2) = 0.5625; neg err mean(0.25^2, 0.25^2) = 0.0625
    # pair 1: pos err mean(0.25^2, 0.5^2) = 0.15625; neg err mean(0.25^2, 0.5^2) = 0.15625
    assert torch.allclose(pos, torch.tensor([[0.25, -0.25], [0.75, 0.0]]))
    assert torch.allclose(neg, torch.tensor([[0.75, -0.75], [0.25, 0.0]]))
    expected = torch.tensor([(0.75 * 0.5625 + 0.25 * 0.0625) / beta, 0.15625 / beta])
    assert torch.allclose(loss, expected)
    assert float(info["optimality_mean"]) == pytest.approx(0.375)


def test_nft_adaptive_weight_by_hand():
    # one pair, beta 1, r = 1: the positive term only, v+ = v: s^2 mean((v-u)^2) / (s mean|v-u|)
    v, u, s = torch.tensor([[0.0, 2.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor([0.5])
    loss, _ = get_objective("nft")(v, u, torch.tensor([5.0]), s, old_pred=torch.zeros(1, 2), adv_clip_max=5.0)
    assert float(loss) == pytest.approx(0.25 * 2.5 / (0.5 * 1.5))


def test_nft_beta_one_positive_is_flow_matching():
    """beta = 1, r = 1: v+ = v_theta, the loss is the plain matching error whatever v_old."""
    loss, _ = get_objective("nft")(V, U, torch.full((2,), 5.0), SIGMA, old_pred=V_OLD * 7, beta=1.0,
                                   adaptive_weight=False)
    assert torch.allclose(loss, torch.tensor([1.0, 0.25]))


@pytest.mark.parametrize("beta", [1.0, 0.1, 1e-4])
def test_nft_gradient_at_the_old_model(beta):
    """At v_theta = v_old the gradient is 2 (2r - 1) (v_old - u) / D for every beta: zero for A = 0 (r = 1/2)."""
    a = torch.tensor([2.5, 0.0])  # r = 0.75, 0.5
    v = V_OLD.clone().requires_grad_(True)
    loss, _ = get_objective("nft")(v, U, a, SIGMA, old_pred=V_OLD, adv_clip_max=5.0, beta=beta, adaptive_weight=False)
    loss.sum().backward()
    r = torch.tensor([0.75, 0.5])[:, None]
    expected = 2 * (2 * r - 1) * (V_OLD - U) / 2
    assert torch.allclose(v.grad, expected, atol=1e-5)
    assert torch.equal(v.grad[1], torch.zeros(2))


def test_nft_small_beta_limit():
    """Away from v_old, as beta -> 0 the gradient tends to the one at v_old (2 (2r - 1) (v_old - u) / D)."""
    a = torch.tensor([2.5, -2.5])
    r = torch.tensor([0.75, 0.25])[:, None]
    v = V.clone().requires_grad_(True)
    loss, _ = get_objective("nft")(v, U, a, SIGMA, old_pred=V_OLD, adv_clip_max=5.0, beta=1e-6, adaptive_weight=False)
    loss.sum().backward()
    assert torch.allclose(v.grad, 2 * (2 * r - 1) * (V_OLD - U) / 2, atol=1e-4)


def test_nft_errors_name_the_values():
    with pytest.raises(ValueError, match="old_pred"):
        get_objective("nft")(V, U, torch.zeros(2), SIGMA)
    with pytest.raises(ValueError, match="beta=0"):
        get_objective("nft")(V, U, torch.zeros(2), SIGMA, old_pred=V_OLD, beta=0)
    assert get_objective("nft").config_errors({"beta": -1}) == [
        "algorithm.objective_kwargs.beta=-1 must be > 0 (DiffusionNFT's guidance strength)"]
    assert "weighting='x'" in get_objective("awm").config_errors({"weighting": "x"})[0]
    assert get_objective("awm").config_errors({"ghuber_power": 0}) == [
        "algorithm.objective_kwargs.ghuber_power=0 must be > 0"]
    with pytest.raises(ValueError, match="awm weighting 'x'"):
        get_objective("awm")(V, U, torch.zeros(2), SIGMA, weighting="x")
    with pytest.raises(ValueError, match=r"advantages and sigma must be \[2\]"):
        get_objective("awm")(V, U, torch.zeros(3), SIGMA)


def test_ddpm_forward_by_hand():
    from ddpo_group.algorithms.objectives import ddpm_forward

    x_clean, eps, ab = torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 4.0]]), torch.tensor([0.64])
    x_t, target = ddpm_forward(x_clean, eps, ab, "epsilon")
    assert torch.allclose(x_t, torch.tensor([[1.6, 2.4]])) and torch.equal(target, eps)  # 0.8 x_clean + 0.6 eps
    _, v = ddpm_forward(x_clean, eps, ab, "v_prediction")
    assert torch.allclose(v, torch.tensor([[-1.2, 3.2]]))  # 0.8 eps - 0.6 x_clean
    assert torch.equal(ddpm_forward(x_clean, eps, ab, "sample")[1], x_clean)
    with pytest.raises(ValueError, match="prediction_type='flow'"):
        ddpm_forward(x_clean, eps, ab, "flow")
    assert get_objective("awm").processes == ("flow", "ddpm") and get_objective("nft").processes == ("flow",)


def test_a_plugin_objective_by_path(tmp_path):
    plugin = tmp_path / "my_objective.py"
    plugin.write_text(
        "from ddpo_group.algorithms import objective\n\n"
        "@objective(processes=('flow', 'ddpm'))\n"
        "def half_awm(pred, target, advantages, sigma, scale=0.5, **_):\n"
        "    return scale * advantages * ((pred - target) ** 2).flatten(1).mean(1), {}\n\n"
        "def plain(pred, target, advantages, sigma, **_):\n"
        "    return advantages * 0.0, {}\n"
    )
    spec = get_objective(f"{plugin}:half_awm")
    assert spec.is_matching and spec.processes == ("flow", "ddpm") and not spec.needs_old_model
    loss, _ = spec(V, U, torch.tensor([2.0, -1.0]), SIGMA)
    assert torch.allclose(loss, torch.tensor([1.0, -0.125]))
    plain = get_objective(f"{plugin}:plain")  # undecorated: a matching objective on the flow process
    assert plain.is_matching and plain.processes == ("flow",)


def test_preference_pairs():
    from ddpo_group.algorithms import preference_pairs

    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3])
    scores = torch.tensor([0.1, 0.9, -0.3, 0.5, 0.5, 1.0, 2.0, 7.0])  # group 1: equal, group 3: one row
    assert preference_pairs(groups, scores).tolist() == [[1, 2], [6, 5]]
    mask = torch.tensor([1, 0, 1, 1, 1, 1, 1, 1])
    assert preference_pairs(groups, scores, mask).tolist() == [[0, 2], [6, 5]]
    assert preference_pairs(torch.tensor([0, 0]), torch.tensor([1.0, 1.0])).shape == (0, 2)


def test_dpo_by_hand_and_at_the_reference():
    dpo = get_objective("dpo")
    assert dpo.kind == "preference" and dpo.processes == ("flow", "ddpm") and dpo.units == "pairs"
    errors = torch.tensor([[0.3, 0.4], [0.5, 0.2]])  # [winner, loser] per pair
    ref = torch.tensor([[0.35, 0.4], [0.5, 0.1]])
    loss, info = dpo(errors, ref, beta=10.0)
    # margins: (0.3-0.35)-(0.4-0.4) = -0.05 -> inside 0.25; (0.5-0.5)-(0.2-0.1) = -0.1 -> inside 0.5
    expected = -torch.nn.functional.logsigmoid(torch.tensor([0.25, 0.5]))
    assert torch.allclose(loss, expected) and float(info["accuracy"]) == 1.0
    # at the reference: log 2, gradient beta / 4 (grad e_w - grad e_l)
    e = torch.tensor([[0.3, 0.4]], requires_grad=True)
    loss, _ = dpo(e, e.detach().clone(), beta=8.0)
    loss.sum().backward()
    assert float(loss) == pytest.approx(float(torch.log(torch.tensor(2.0))))
    assert e.grad.tolist() == [[2.0, -2.0]]
    assert dpo.config_errors({"beta": 0}) == [
        "algorithm.objective_kwargs.beta=0 must be > 0 (Diffusion-DPO's temperature)"]


def test_dgpo_by_hand_its_limits_and_dpo_as_its_pair_case():
    dgpo = get_objective("dgpo")
    assert dgpo.units == "groups"
    errors = torch.tensor([[0.2, 0.5, 0.4]], requires_grad=True)
    ref = torch.tensor([[0.3, 0.5, 0.2]])
    adv = torch.tensor([[1.0, 0.0, -1.0]])
    loss, _ = dgpo(errors, ref, adv, beta=6.0)
    # S = 6/3 * (1 * -0.1 + 0 + -1 * 0.2) = -0.6; loss = softplus(-0.6)
    assert float(loss) == pytest.approx(float(torch.nn.functional.softplus(torch.tensor(-0.6))))
    loss.sum().backward()
    # gradient sigmoid(S) * (beta / K) * A_k
    assert torch.allclose(errors.grad, torch.sigmoid(torch.tensor(-0.6)) * 2.0 * adv)
    # zero advantages: log 2, zero gradient
    e = torch.tensor([[0.2, 0.5]], requires_grad=True)
    loss, _ = dgpo(e, torch.tensor([[0.1, 0.9]]), torch.zeros(1, 2), beta=100.0)
    loss.sum().backward()
    assert float(loss) == pytest.approx(float(torch.log(torch.tensor(2.0)))) and torch.equal(e.grad, torch.zeros(1, 2))
    # dpo is dgpo on (winner, loser) with advantages (+1, -1)
    pair, pair_ref = torch.tensor([[0.3, 0.4]]), torch.tensor([[0.2, 0.6]])
    assert torch.allclose(get_objective("dpo")(pair, pair_ref, beta=7.0)[0],
                          dgpo(pair, pair_ref, torch.tensor([[1.0, -1.0]]), beta=7.0)[0])
    with pytest.raises(ValueError, match=r"must be \[U, K\]"):
        dgpo(torch.zeros(2), torch.zeros(2), torch.zeros(2))


def test_group_rows():
    from ddpo_group.algorithms import group_rows

    assert group_rows(torch.tensor([1, 0, 1, 0])).tolist() == [[1, 3], [0, 2]]
    with pytest.raises(ValueError, match=r"prompt groups of different sizes \[1, 2\]"):
        group_rows(torch.tensor([0, 0, 1]))


def test_draw_times_and_their_shift():
    from ddpo_group.algorithms import draw_times

    torch.manual_seed(0)
    u = torch.rand(5)
    torch.manual_seed(0)
    assert torch.allclose(draw_times(5, "uniform", shift=3.0), 3 * u / (1 + 2 * u))
    torch.manual_seed(1)
    z = torch.randn(4)
    torch.manual_seed(1)
    assert torch.allclose(draw_times(4, "logit_normal"), torch.sigmoid(z))
    s = draw_times(1000, "uniform", shift=3.0)
    assert 0 <= float(s.min()) and float(s.max()) <= 1 and float(s.mean()) > 0.6  # shifted toward the noise
    with pytest.raises(ValueError, match="time sampling 'schedule' draws no times"):
        draw_times(2, "schedule")


def test_awm_old_kl_by_hand():
    awm = get_objective("awm")
    assert not awm.uses_old_model({}) and awm.uses_old_model({"old_kl_beta": 0.1})
    assert not awm.uses_old_model({"old_kl_beta": 0.0}) and get_objective("nft").uses_old_model({})
    a = torch.tensor([2.0, -1.0])
    loss, info = awm(V, U, a, SIGMA, old_pred=V_OLD, old_kl_beta=0.5)
    # matching terms [2, -0.25]; old KL: mean((0-0.5)^2, (0+0.5)^2) = 0.25, mean((1-0.5)^2, 0) = 0.125
    assert torch.allclose(loss, torch.tensor([2.0 + 0.5 * 0.25, -0.25 + 0.5 * 0.125]))
    assert float(info["old_kl"]) == pytest.approx(0.1875)
    with pytest.raises(ValueError, match="old_kl_beta > 0 needs the old model"):
        awm(V, U, a, SIGMA, old_kl_beta=0.5)
    assert awm.config_errors({"old_kl_beta": -1}) == ["algorithm.objective_kwargs.old_kl_beta=-1 must be >= 0"]
