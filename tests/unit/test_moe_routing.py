"""Routing replay on a tiny Qwen3-MoE (moe/routing.py): recorded routes replayed reproduce the forward exactly,
other routes change it as the experts they name compute it, the router still gets its gradient, and -1 keeps the
router's own choice."""
import pytest
import torch

from asyncrl.learner.families import build_family_model
from asyncrl.moe.routing import RouteRecorder, RoutingReplay, moe_routers, replayed_output


@pytest.fixture(scope="module")
def moe():
    model = build_family_model("qwen3_moe", 40, seed=0, num_layers=2)
    model.config.norm_topk_prob = True
    for _, router in moe_routers(model):
        router.norm_topk_prob = True
        torch.nn.init.normal_(router.weight, std=0.5)  # the init's zeros would make every route a tie
    return model


def logits_of(model, ids):
    return model(input_ids=ids, use_cache=False).logits


def test_replaying_the_recorded_routes_gives_the_same_forward_and_other_routes_change_it(moe):
    config = moe.config
    ids = torch.randint(0, 40, (3, 7), generator=torch.Generator().manual_seed(1))
    recorder = RouteRecorder(moe, config.num_hidden_layers)
    with torch.no_grad():
        own = logits_of(moe, ids)
    routes = recorder.chosen(3, 7)
    recorder.remove()
    assert routes.shape == (3, 7, config.num_hidden_layers, config.num_experts_per_tok)
    assert int(routes.min()) >= 0 and int(routes.max()) < config.num_experts
    replay = RoutingReplay(moe, config.num_hidden_layers, config.num_experts_per_tok, config.num_experts)
    try:
        replay.set_routes(routes)
        with torch.no_grad():
            torch.testing.assert_close(logits_of(moe, ids), own, rtol=0, atol=0)  # the same experts, the same weights
        replay.set_routes(torch.full_like(routes, -1))  # no route anywhere: the routers choose
        with torch.no_grad():
            torch.testing.assert_close(logits_of(moe, ids), own, rtol=0, atol=0)
        other = (routes + 1) % config.num_experts  # every token to other experts
        replay.set_routes(other)
        moe.zero_grad()
        replayed = logits_of(moe, ids)
        assert (replayed - own).abs().max() > 1e-4
        replayed.logsumexp(-1).sum().backward()
        for _, router in replay.routers:
            assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0  # the router still learns
        replay.set_routes(None)
        with torch.no_grad():
            torch.testing.assert_close(logits_of(moe, ids), own, rtol=0, atol=0)
        with pytest.raises(ValueError, match="expected"):
            replay.set_routes(routes[:, :, :1])
    finally:
        replay.remove()
        moe.zero_grad()


def test_the_replayed_weights_are_the_routers_softmax_at_the_replayed_experts():
    logits = torch.tensor([[2.0, 0.0, -1.0, 1.0]])
    probs = torch.softmax(logits, -1)
    own = (logits, probs.topk(2).values, probs.topk(2).indices)  # experts 0 and 3
    _, weights, indices = replayed_output(own, torch.tensor([[2, -1]]), norm_topk_prob=False)
    assert indices.tolist() == [[2, 3]]  # -1 keeps the router's own second choice
    torch.testing.assert_close(weights, probs[:, [2, 3]])
    _, normed, _ = replayed_output(own, torch.tensor([[1, 2]]), norm_topk_prob=True)
    torch.testing.assert_close(normed, probs[:, [1, 2]] / probs[:, [1, 2]].sum())
    with pytest.raises(ValueError, match="routes of shape"):
        replayed_output(own, torch.tensor([[1, 2, 3]]), norm_topk_prob=False)


def test_a_model_without_a_replayable_router_is_refused():
    dense = build_family_model("qwen2", 40)
    with pytest.raises(ValueError, match="no MoE router"):
        RoutingReplay(dense, 2, 2, 4)
    with pytest.raises(ValueError, match="no MoE router"):
        RouteRecorder(dense, 2)
