"""The evidence attention loss: designated heads are shown where the target is read from.

At the position before each evidenced target token, a reading head's attention row is pushed onto the token
positions the example says the token is read from (m1/evidence.py): the loss is -log of the attention mass on those
positions, so several evidence positions share the target mass and a row already on the evidence has no gradient.
Optional structural heads are pushed onto the previous token and the token two back at every position, which
lookups keyed by several words need (docs/experiments/mini_base.md: the attention probe).

Only the supervised heads' attention is computed, from their own queries and keys: hooks keep each supervised
layer's attention input during the ordinary forward pass, and the rows are recomputed from it (the model keeps its
fast attention kernel and never materialises every attention map). The model stays a plain checkpoint: nothing is
supervised at inference. Supported: Qwen2 / Qwen3 text models (full or LoRA); other architectures are refused by
name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from pydantic import Field, model_validator

from m1.config import Strict

Rows = Sequence[Sequence[tuple[int, Sequence[int]]]]  # per sequence: (query position, evidence positions)


class AttentionLossSettings(Strict):
    """The evidence attention loss's settings (shared by `m1 pretrain` and `m1 sft`)."""

    weight: float = Field(default=0.0, ge=0, description=(
        "Weight of the attention loss added to the next-token loss; 0 turns it off (the default for real models)."))
    read_heads: list[tuple[int, int]] = Field(default_factory=lambda: [(-1, 0)], description=(
        "Reading heads as [layer, head] (negative layers count from the last): at the position before each "
        "evidenced target token each is pushed onto the evidence positions."))
    prev_head: tuple[int, int] | None = Field(default=(0, 0), description=(
        "A structural head [layer, head] pushed onto the previous token at every position; null: none."))
    prev2_head: tuple[int, int] | None = Field(default=(0, 1), description=(
        "A structural head [layer, head] pushed onto the token two back at every position (lookups keyed by two "
        "words need it); null: none."))

    structural_every: int = Field(default=8, ge=1, description=(
        "The structural heads are supervised at every n-th position (each row costs a pass over the sequence)."))

    @model_validator(mode="after")
    def _distinct(self) -> AttentionLossSettings:
        heads = [*self.read_heads, *[h for h in (self.prev_head, self.prev2_head) if h is not None]]
        if len(set(map(tuple, heads))) != len(heads):
            raise ValueError(f"attention loss: a head is given two jobs: {heads}")
        return self

    @property
    def on(self) -> bool:
        return self.weight > 0


def decoder_layers(model) -> Sequence[Any]:
    """The decoder layers of a Qwen2/Qwen3 causal LM, bare or wrapped by peft."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(layers[0], "self_attn") or not hasattr(layers[0].self_attn, "q_proj"):
        raise ValueError(f"attention loss: {type(base).__name__} is not supported (Qwen2/Qwen3 text models are)")
    return layers


def _rotate(x, cos, sin):
    import torch

    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class HeadScores:
    """Keeps the attention inputs of chosen layers during a forward pass (a context manager over it) and computes
    one head's attention logits from them, with the model's own projections, norms and rotary embedding."""

    def __init__(self, model, layers: Sequence[int]):
        self.layers = decoder_layers(model)
        n = len(self.layers)
        self.wanted = sorted({l % n for l in layers})
        self.inputs: dict[int, tuple[Any, Any]] = {}
        self.handles: list[Any] = []

    def __enter__(self) -> HeadScores:
        for l in self.wanted:
            self.handles.append(self.layers[l].self_attn.register_forward_pre_hook(self._keeper(l), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _keeper(self, layer: int) -> Callable:
        def keep(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            if cos.dim() != 3:
                raise ValueError("attention loss: multimodal rotary embeddings are not supported")
            self.inputs[layer] = (hidden, (cos, sin))
        return keep

    def _project(self, proj, x, index: int, dim: int):
        import torch.nn.functional as F
        from torch import nn

        if type(proj) is nn.Linear:  # slice the one head's rows rather than projecting every head
            rows = slice(index * dim, (index + 1) * dim)
            return F.linear(x, proj.weight[rows], None if proj.bias is None else proj.bias[rows])
        return proj(x).unflatten(-1, (-1, dim))[..., index, :]  # LoRA and other wrapped projections

    def logits(self, layer: int, head: int, key_mask=None, queries=None):
        """Attention logits of `head` in `layer`: (B, R, T) at the query positions `queries` (B, R), or (B, T, T)
        at every position; causal, and padded keys (key_mask 0) at -inf except on their own row."""
        import torch

        layer %= len(self.layers)
        if layer not in self.inputs:
            raise RuntimeError(f"attention loss: layer {layer} was not captured (run the forward pass inside)")
        attn = self.layers[layer].self_attn
        x, (cos, sin) = self.inputs[layer]
        b, t = x.shape[:2]
        if queries is None:
            queries = torch.arange(t, device=x.device).expand(b, t)
        pick = lambda v: v.gather(1, queries[..., None].expand(-1, -1, v.shape[-1]))  # noqa: E731
        dim = attn.head_dim
        q = self._project(attn.q_proj, pick(x), head, dim)
        k = self._project(attn.k_proj, x, head // attn.num_key_value_groups, dim)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = cos.expand(b, -1, -1), sin.expand(b, -1, -1)
        q, k = _rotate(q, pick(cos), pick(sin)), _rotate(k, cos, sin)
        scores = (q @ k.transpose(-1, -2)) * attn.scaling
        keys = torch.arange(t, device=x.device)
        blocked = keys[None, None, :] > queries[..., None]
        if key_mask is not None:  # a padded key is blocked except on its own row (no row is left empty)
            blocked = blocked | ((key_mask[:, None, :] == 0) & (keys[None, None, :] != queries[..., None]))
        return scores.masked_fill(blocked, float("-inf"))


@dataclass
class AttentionLoss:
    """The loss and what it measured: mean -log mass on the evidence per supervised kind of head, and the mean mass
    the reading heads put on the evidence. `parts` are the unweighted terms ("read": summed over the reading heads,
    "prev", "prev2"), loss = weight * their sum: a caller that accumulates micro-batches weighs the evidence rows and
    the structural positions each by its own share of the step."""

    loss: Any
    metrics: dict[str, float]
    parts: dict[str, Any]


def _structural(scores: HeadScores, head: tuple[int, int], back: int, mask, every: int):
    """Mean -log attention on the token `back` positions earlier, at every `every`-th position (the rows cost T
    each, and a structural pattern needs no more than a sample), over real positions that have one."""
    import torch

    x = scores.inputs[scores.wanted[0]][0]
    b, t = x.shape[:2]
    pos = torch.arange(back, t, max(1, every), device=x.device)
    if len(pos) == 0:
        return None
    log_p = scores.logits(*head, mask, pos.expand(b, -1)).log_softmax(-1)
    picked = log_p[:, torch.arange(len(pos)), pos - back]
    real = (mask[:, pos] > 0) & (mask[:, pos - back] > 0) if mask is not None else torch.ones_like(picked, dtype=bool)
    return -(picked[real]).mean() if real.any() else None


def evidence_attention_loss(scores: HeadScores, settings: AttentionLossSettings, rows: Rows,
                            mask=None) -> AttentionLoss | None:
    """The weighted loss over a batch whose forward pass `scores` captured; `rows[b]` lists sequence b's
    (query position, evidence positions). None when nothing is supervised in the batch."""
    import torch

    terms, metrics, parts = [], {}, {}
    x = scores.inputs[scores.wanted[0]][0] if scores.wanted else None
    width = max((len(r) for r in rows), default=0)
    if width and x is not None:
        b, t = x.shape[:2]
        queries = torch.zeros(b, width, dtype=torch.long)
        on = torch.zeros(b, width, t, dtype=torch.bool)
        used = torch.zeros(b, width, dtype=torch.bool)
        on[:, :, 0] = True  # unused rows point at position 0, so that no row is empty (they are left out below)
        for i, rs in enumerate(rows):
            for r, (q, ev) in enumerate(rs):
                queries[i, r], used[i, r] = q, bool(ev)
                on[i, r, 0] = False
                on[i, r, list(ev) or [0]] = True
        masses = []
        for layer, head in settings.read_heads:
            log_p = scores.logits(layer, head, mask, queries.to(x.device)).log_softmax(-1)
            on_ev = log_p.masked_fill(~on.to(x.device), float("-inf")).logsumexp(-1)[used]
            terms.append(-on_ev.mean())
            masses.append(on_ev.detach().exp().mean().item())
        parts["read"] = sum(terms)
        metrics["attn_read"] = round(sum(term.item() for term in terms) / len(terms), 4)
        metrics["attn_evidence_mass"] = round(sum(masses) / len(masses), 4)
    for name, head, back in (("prev", settings.prev_head, 1), ("prev2", settings.prev2_head, 2)):
        if head is not None and x is not None:
            term = _structural(scores, head, back, mask, settings.structural_every)
            if term is not None:
                terms.append(term)
                parts[name] = term
                metrics[f"attn_{name}"] = round(term.item(), 4)
    if not terms:
        return None
    return AttentionLoss(settings.weight * sum(terms), metrics, parts)


def check_heads(model, settings: AttentionLossSettings, where: str = "attention") -> None:
    """Refuse heads the model does not have (a head index past the layer's heads would read another's rows), and
    one head given two jobs once negative layers are counted from this model's last."""
    layers = decoder_layers(model)
    n, heads = len(layers), layers[0].self_attn.config.num_attention_heads
    named = [*settings.read_heads, *[h for h in (settings.prev_head, settings.prev2_head) if h]]
    for layer, head in named:
        if not -n <= layer < n or not 0 <= head < heads:
            raise ValueError(f"{where}: head [{layer}, {head}] is not in this model ({n} layers of {heads} heads)")
    if len({(layer % n, head) for layer, head in named}) != len(named):
        raise ValueError(f"{where}: a head is given two jobs in this {n}-layer model: {[list(h) for h in named]}")


def supervised_layers(settings: AttentionLossSettings) -> list[int]:
    return [l for l, _ in settings.read_heads] + [h[0] for h in (settings.prev_head, settings.prev2_head) if h]
