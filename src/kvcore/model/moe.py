"""The DeepSeek MoE FFN: routing (V2 softmax, grouped or not; V3 sigmoid with correction bias and
group-limited choice), routed experts one GEMM each over their tokens, shared experts.

Routing runs on the host in float32 (the router's logits are copied back once per layer, a few
numbers per token); the expert GEMMs run on the arrays' device (NumPy or CuPy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcore import kernels
from kvcore.config_deepseek import MoEConfig
from kvcore.device import array_module, to_numpy
from kvcore.model.llama import _linear


@dataclass(slots=True)
class MoEWeights:
    gate: Any  # (E, hidden) router, float32 on the model's device
    score_bias: np.ndarray | None  # (E,) V3's e_score_correction_bias (choice only), host
    gate_up: Any  # (E, 2 I, hidden): every expert's gate and up fused
    down: Any  # (E, hidden, I)
    shared_gate_up: Any | None  # (2 I_shared, hidden): the shared experts as one MLP
    shared_down: Any | None  # (hidden, I_shared)


def route(x: np.ndarray, gate: np.ndarray, score_bias: np.ndarray | None,
          moe: MoEConfig) -> tuple[np.ndarray, np.ndarray]:
    """(experts (T, k) int64, weights (T, k) float32) of each token, in float32 as transformers.

    Order within a row is not meaningful (the output sums over it)."""
    return route_logits(x.astype(np.float32) @ gate.T, score_bias, moe)


def route_logits(logits: np.ndarray, score_bias: np.ndarray | None,
                 moe: MoEConfig) -> tuple[np.ndarray, np.ndarray]:
    """route() from the router's (T, E) float32 logits (host)."""
    num_tokens, k = logits.shape[0], moe.num_experts_per_tok
    if moe.scoring_func == "softmax":
        scores = np.exp(logits - logits.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
        choice = scores
        if moe.topk_method == "group_limited_greedy":
            group_best = scores.reshape(num_tokens, moe.num_groups, -1).max(axis=-1)  # (T, G)
            choice = _keep_groups(scores, group_best, moe.topk_group, 0.0)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))  # sigmoid
        choice = scores + score_bias if score_bias is not None else scores
        # a group's score is the sum of its two best experts (V3)
        grouped = choice.reshape(num_tokens, moe.num_groups, -1)
        top2 = -np.partition(-grouped, min(1, grouped.shape[-1] - 1), axis=-1)[..., :2]
        choice = _keep_groups(choice, top2.sum(axis=-1), moe.topk_group, -np.inf)
    experts = np.argpartition(-choice, k - 1, axis=-1)[:, :k]  # (T, k)
    weights = np.take_along_axis(scores, experts, axis=-1)  # the scores, never the bias
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    weights = weights * np.float32(moe.routed_scaling_factor)
    return experts.astype(np.int64), weights.astype(np.float32)


def _keep_groups(scores: np.ndarray, group_scores: np.ndarray, topk_group: int,
                 fill: float) -> np.ndarray:
    """scores with every expert outside each token's topk_group best groups set to fill."""
    num_tokens, num_groups = group_scores.shape
    best = np.argpartition(-group_scores, topk_group - 1, axis=-1)[:, :topk_group]
    keep = np.zeros((num_tokens, num_groups), dtype=bool)  # (T, G)
    np.put_along_axis(keep, best, True, axis=-1)
    keep = np.repeat(keep, scores.shape[-1] // num_groups, axis=-1)  # (T, E)
    return np.where(keep, scores, np.float32(fill)).astype(np.float32)


def moe_ffn(x: Any, w: MoEWeights, moe: MoEConfig) -> Any:
    """Shared experts on every token plus the weighted sum of its routed experts: (T, hidden).

    Tokens are grouped by expert, so each chosen expert runs one GEMM pair over all its tokens
    of the step rather than one per token."""
    xp = array_module(x)
    num_tokens, k = x.shape[0], moe.num_experts_per_tok
    logits = to_numpy(x.astype(np.float32) @ w.gate.T)  # (T, E) on the host: one small copy
    experts, weights = route_logits(logits, w.score_bias, moe)
    flat = experts.reshape(-1)  # (T k,) expert of each (token, slot)
    order = np.argsort(flat, kind="stable")  # (token, slot) pairs grouped by expert
    counts = np.bincount(flat, minlength=moe.num_experts)
    ends = np.cumsum(counts)
    order_x = xp.asarray(order)  # one upload; each expert's pairs are a slice of it
    routed = xp.empty((num_tokens * k, x.shape[1]), dtype=x.dtype)  # (T k, hidden)
    for e in np.flatnonzero(counts):
        pairs = order_x[ends[e] - counts[e]:ends[e]]
        rows = x[pairs // k]  # (n_e, hidden) this expert's tokens
        routed[pairs] = _mlp(rows, w.gate_up[e], w.down[e])
    out = xp.einsum("tkh,tk->th", routed.reshape(num_tokens, k, -1),
                    xp.asarray(weights.astype(x.dtype)))  # (T, hidden)
    if w.shared_gate_up is not None and w.shared_down is not None:
        out += _mlp(x, w.shared_gate_up, w.shared_down)
    return out


def _mlp(x: Any, gate_up: Any, down: Any) -> Any:
    """SwiGLU: down(silu(gate x) * up x), gate and up as one (2 I, hidden) weight; _linear's
    weight-left product for the few rows an expert usually gets."""
    return _linear(kernels.silu_and_mul(_linear(x, gate_up)), down)
