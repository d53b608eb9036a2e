"""Rollout routing replay for mixture-of-experts models (`learner.moe_routing_replay`): the sampler records the
experts each token went to (`RouteRecorder`, the `hf` engine; vLLM returns them itself), the learner replays them
(`RoutingReplay`). One module for both sides, so both read a model's routers alike.

On an MoE model the sampler and the learner can send a token to different experts: their numerics differ a little
(another engine, another batch, weights a few versions apart), and where two experts' router scores are close that
is enough to flip the top-k. The token's logprob then comes from different experts on the two sides, a mismatch
that importance ratios read as off-policyness and that grows with staleness. Replaying the sampler's routes in the
learner's forward removes it: each token of a sample goes to the experts the sampler chose (the generators send
them with the group: `Sample.routed_experts`), so π_θ is computed on the sampler's routes.

The router still trains as the loss defines: the replayed experts' weights are the router's own softmax
probabilities at those experts (renormalised over them where the model normalises its top-k), so the gradient
reaches the router through the weights of the experts the tokens went to, exactly as it does without replay; only
the choice of experts (a non-differentiable top-k) is the sampler's.

How: a forward hook (PyTorch's public `register_forward_hook`) on each MoE router replaces the router's output
(logits, top-k weights, top-k indices) by (the same logits, the weights at the replayed indices, the replayed
indices). The hooks stay on for the model's life and read the routes of the current micro-batch from one
`RoutingReplay` object, set before each forward (`set_routes`), so a backward that recomputes a checkpointed layer
replays the same routes as its forward did. A position without a route (-1: padding, and each sample's last token,
which the sampler never ran through the model) keeps the router's own choice; its output trains nothing.

Supported routers are the softmax-top-k routers of `ROUTERS` (transformers' Qwen3-MoE family); a model with another
router is refused when the learner builds it, not silently run without replay.
"""
import torch

ROUTERS = ("Qwen3MoeTopKRouter",)
"""Router classes whose output is (logits [N, E], top-k weights [N, k] = softmax(logits) at the top-k indices,
renormalised when `norm_topk_prob`, top-k indices [N, k]); replay recomputes the weights by that rule."""


def routing_shape(config) -> tuple:
    """(num_layers, top_k, num_experts) of an MoE model's config: the shape its routes travel in (every decoder
    layer, dense ones included, as vLLM reports them)."""
    missing = [key for key in ("num_hidden_layers", "num_experts_per_tok", "num_experts") if not hasattr(config, key)]
    if missing:
        raise ValueError(f"routing replay needs a mixture-of-experts model; the model's config has no {missing}")
    return int(config.num_hidden_layers), int(config.num_experts_per_tok), int(config.num_experts)


def moe_routers(model) -> list:
    """[(decoder layer index, router module)] of `model`, in layer order; a router is found by its class name and
    its layer by the `layers.<i>.` in its module name."""
    routers = []
    for name, module in model.named_modules():
        if type(module).__name__ in ROUTERS:
            parts = name.split(".")
            index = next((int(parts[i + 1]) for i in range(len(parts) - 1) if parts[i] == "layers"
                          and parts[i + 1].isdigit()), None)
            if index is None:
                raise ValueError(f"MoE router {name} is not inside a numbered decoder layer (layers.<i>)")
            routers.append((index, module))
    return sorted(routers, key=lambda pair: pair[0])


def replayed_output(output: tuple, routes: torch.Tensor, norm_topk_prob: bool) -> tuple:
    """The router's output on the replayed `routes` ([N, k] int, -1: keep the router's own choice there)."""
    logits, own_weights, own_indices = output
    if routes.shape != own_indices.shape:
        raise ValueError(f"routing replay: routes of shape {tuple(routes.shape)} for a router that chose "
                         f"{tuple(own_indices.shape)} (tokens x top-k)")
    routes = routes.to(device=own_indices.device, dtype=torch.long)
    indices = torch.where(routes >= 0, routes, own_indices)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(own_weights.dtype), indices


class RoutingReplay:
    """The hooks on one model's routers and the routes they replay now ([R, S, num_layers, k] or None)."""

    def __init__(self, model, num_layers: int, top_k: int, num_experts: int):
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"learner.moe_routing_replay is on, but the model has no MoE router asyncrl can replay "
                             f"(supported: {', '.join(ROUTERS)})")
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.routes: torch.Tensor | None = None
        self._handles = [router.register_forward_hook(self._hook(layer)) for layer, router in self.routers]

    def set_routes(self, routes: torch.Tensor | None) -> None:
        """Replay `routes` ([R, S, num_layers, top_k], -1 where a position has none) in every forward until the
        next call; None: the routers choose. Set before each forward, the micro-batch's own."""
        if routes is not None and (routes.dim() != 4 or tuple(routes.shape[2:]) != (self.num_layers, self.top_k)):
            raise ValueError(f"routing replay: routes of shape {tuple(routes.shape)}, expected [rows, positions, "
                             f"{self.num_layers}, {self.top_k}]")
        self.routes = routes

    def _hook(self, layer: int):
        def replay(module, args, output):
            if self.routes is None:
                return output
            return replayed_output(output, self.routes[:, :, layer, :].reshape(-1, self.top_k),
                                   bool(module.norm_topk_prob))
        return replay

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class RouteRecorder:
    """Forward hooks that keep the experts each MoE router chose in the model's last forward: the `hf` engine reads
    them after its prefill and after each decode step (`chosen`)."""

    def __init__(self, model, num_layers: int):
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"routing replay is on, but the model has no MoE router asyncrl can record (supported: "
                             f"{', '.join(ROUTERS)})")
        self.num_layers = num_layers
        self._last: dict = {}
        self._handles = [router.register_forward_hook(self._hook(layer)) for layer, router in self.routers]

    def _hook(self, layer: int):
        def record(module, args, output):
            self._last[layer] = output[2].detach()
        return record

    def chosen(self, rows: int, positions: int) -> torch.Tensor:
        """[rows, positions, num_layers, top_k] int64 of the last forward (over rows x positions tokens); the
        layers without a router (dense ones) hold 0, as vLLM reports them."""
        first = self._last[self.routers[0][0]]
        out = torch.zeros(rows, positions, self.num_layers, first.shape[-1], dtype=torch.long)
        for layer, _ in self.routers:
            out[:, :, layer] = self._last[layer].view(rows, positions, -1)
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
