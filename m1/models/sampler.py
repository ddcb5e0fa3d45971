"""The sampler of a local (hf) text chat model: prefill with a prompt-prefix cache, then a decode loop that drops
finished rows.

Why: on the mini team a MARL step spends most of its time in prefill, not decode (scripts/profile_loop.py,
benchmarks/README.md): the K rollouts of a question send the same plan prompt, their later prompts repeat its system
prompt, question and shared notes, and a second communicate round repeats the first. As vLLM's automatic prefix
caching does, prompts are cut into blocks of `BLOCK` tokens and the keys and values of every full block are kept,
keyed by the block's tokens and the blocks before it (exact: a tree of token tuples, no hashes that could collide);
a new prompt runs only the tokens after its longest cached prefix (on CPU each distinct prompt alone on its own
cached blocks when that costs less than one padded batch, `PrefixSampler._alone_pays`). The cache belongs to one
model and is emptied whenever its weights change (the sum of the parameters' in-place version counters moves at
every optimizer step and weight load; an actor also empties it after each of those, m1/marl/actor/learner.py
`Actor.weights_changed`, since writes through `.data` move no counter), so a learner's sampler never reuses keys of
older weights. Entries are evicted least recently used past `max_bytes`.

Sampling is `RowSampler`'s (below; transformers' generate samples through it too, m1/models/hf.py): row i
draws one uniform vector per step it is alive from a generator seeded with seeds[i] and takes
argmax(logits / T + Gumbel noise) after top_p; its log-prob is log_softmax(logits / T)[token] before top_p. So a
row's tokens depend only on its prompt, its seed and the weights, as before: greedy answers are unchanged, and
sampled ones come from the same draws.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any

BLOCK = 16  # tokens per cached block: long enough to keep the per-block bookkeeping cheap, short enough to share
# a forward's fixed cost per layer, in FLOPs at one core's matmul rate (~0.45 ms a layer at ~50 GFLOP/s on the mini
# team's models: scripts/profile_loop.py); only `PrefixSampler._alone_pays` uses it, to weigh U calls
# against one batched call
CALL_FLOPS = 2e7


def supports(model) -> bool:
    """Whether the sampler can run `model`: a text causal LM whose every layer attends to its whole context
    (a sliding-window layer's cache is cut to its window)."""
    config = model.config
    if getattr(config, "vision_config", None) is not None or not hasattr(config, "num_hidden_layers"):
        return False
    types = getattr(config, "layer_types", None)
    if types is not None:
        return all(t == "full_attention" for t in types)
    return not getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None) in (None, 0)


def weights_version(model) -> tuple[int, int]:
    """Changes whenever a parameter is written in place (optimizer steps, load_state_dict, copy_)."""
    return id(model), sum(p._version for p in model.parameters())


def draw_seeds(seeds: list[int | None], params) -> list[int | None]:
    """The seeds of a sampling call with every missing one filled from one fresh draw (an unseeded call samples anew
    each time); unchanged when greedy."""
    import torch

    if params.temperature > 0 and any(s is None for s in seeds):
        base = int(torch.randint(0, 2 ** 62, (1,)).item())
        seeds = [base + i if s is None else s for i, s in enumerate(seeds)]
    return seeds


def top_p_filter(scaled, top_p: float):
    """`scaled` logits with every token outside the smallest set of probability mass >= top_p set to -inf."""
    import torch

    ordered, order = torch.sort(scaled, dim=-1, descending=True)
    mass_before = torch.softmax(ordered, dim=-1).cumsum(-1) - torch.softmax(ordered, dim=-1)
    drop = mass_before >= top_p  # the most likely token always stays (its mass before is 0)
    return scaled.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


class RowSampler:
    """A logits processor that makes a greedy `generate` sample each row from its own seed.

    argmax(logits / T + Gumbel noise) is a draw from softmax(logits / T); drawing the noise of row i from a
    generator seeded with seeds[i] makes row i's sample depend only on its prompt and its seed, not on which rows
    share the batch, how the requests were chunked or which learner rank ran them (with one seed per call, K
    copies of a question split over two ranks sampled the same tokens twice). It also records each chosen token's
    log-prob, log_softmax(logits / T)[token] before top_p, keeping one step's [B, V] at a time instead of every
    step's logits."""

    def __init__(self, seeds: list[int] | None, params: SamplingParams, device):
        """`seeds`: one per row when sampling (temperature > 0), else None."""
        import torch

        self.temperature = params.temperature if params.temperature > 0 else 1.0
        self.top_p, self.want_logprobs = float(params.top_p), bool(params.logprobs)
        self.generators = None
        if params.temperature > 0:
            self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        self.last = None  # the previous step's log-probs [B, V] until its chosen token is known
        self.steps: list = []

    def __call__(self, input_ids, scores):
        if self.last is not None:
            self.steps.append(self.last.gather(1, input_ids[:, -1:]).squeeze(1))
        noisy, self.last = self.scores(scores, self.generators)
        return noisy

    def scores(self, logits, generators):
        """(logits / T, plus each row's Gumbel noise from `generators` when sampling, after top_p; the log-probs
        log_softmax(logits / T) or None). One uniform draw per row and step: row i's draws are its own."""
        import torch

        scaled = logits.float() / self.temperature
        logp = torch.log_softmax(scaled, dim=-1) if self.want_logprobs else None
        if generators is None:
            return scaled, logp
        if self.top_p < 1.0:
            scaled = top_p_filter(scaled, self.top_p)
        width = scaled.shape[-1]
        uniform = torch.stack([torch.rand(width, generator=g, device=scaled.device) for g in generators])
        tiny = torch.finfo(uniform.dtype).tiny
        gumbel = -torch.log(-torch.log(uniform.clamp(min=tiny, max=1.0 - 1e-7)))
        return scaled + gumbel, logp

    def logprobs(self, sequences):
        """[B, steps] log-probs of the generated tokens (None when not asked for)."""
        import torch

        if not self.want_logprobs:
            return None
        if self.last is not None:
            self.steps.append(self.last.gather(1, sequences[:, -1:]).squeeze(1))
            self.last = None
        return torch.stack(self.steps, dim=1) if self.steps else None


class PrefixCache:
    """Keys and values of prompt blocks computed under one version of a model's weights.

    A block is identified by (its parent block's id, its tokens); its value is a tensor [layers, 2, kv_heads,
    BLOCK, head_dim] (keys, values), on the model's device."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = int(max_bytes), 0
        self.version: tuple[int, int] | None = None
        self.ids: dict[tuple[int, tuple[int, ...]], int] = {}
        self.blocks: OrderedDict[int, Any] = OrderedDict()  # block id -> kv, least recently used first
        self.keys_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.next_id = 1
        self.hits = self.lookups = 0  # tokens found / asked for (for the profile and tests)

    def check(self, version: tuple[int, int]) -> None:
        if version != self.version:
            self.clear()
            self.version = version

    def clear(self) -> None:
        self.ids.clear()
        self.blocks.clear()
        self.keys_of.clear()
        self.bytes = 0

    def lookup(self, prompt: list[int]) -> list:
        """The cached blocks of `prompt`'s longest cached prefix, leaving at least one token to run."""
        found, parent = [], 0
        for start in range(0, len(prompt) - 1 - BLOCK + 1, BLOCK):
            bid = self.ids.get((parent, tuple(prompt[start:start + BLOCK])))
            if bid is None:  # an evicted block leaves `ids` too
                break
            self.blocks.move_to_end(bid)
            found.append(self.blocks[bid])
            parent = bid
        self.lookups += len(prompt)
        self.hits += len(found) * BLOCK
        return found

    def store(self, prompt: list[int], kv_of) -> None:
        """Keep every full block of `prompt` not kept yet; `kv_of(start)` gives the tensor of the block at token
        `start`."""
        parent = 0
        for start in range(0, len(prompt) - BLOCK + 1, BLOCK):
            key = (parent, tuple(prompt[start:start + BLOCK]))
            bid = self.ids.get(key)
            if bid is None:
                bid, self.next_id = self.next_id, self.next_id + 1
                self.ids[key] = bid
                self.keys_of[bid] = key
                kv = kv_of(start)
                self.blocks[bid] = kv
                self.bytes += kv.numel() * kv.element_size()
            parent = bid
        while self.bytes > self.max_bytes and self.blocks:
            bid, kv = self.blocks.popitem(last=False)
            self.bytes -= kv.numel() * kv.element_size()
            self.ids.pop(self.keys_of.pop(bid), None)


def _layer_weights(model) -> int:
    """Weights a prompt token multiplies in the layers: every matrix but the embedding and output layer."""
    skip = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in skip)


@functools.cache
def _buffer_layer():
    """DynamicLayer (imported late, as transformers is) whose keys and values live in a buffer sized for the whole
    call: a decode step writes its column in place, where DynamicLayer's torch.cat copies the whole cache every step
    (at 16 rows of 600-token prompts that copy is a large share of a decode step). Same values, bit for bit."""
    from transformers.cache_utils import DynamicLayer

    class BufferLayer(DynamicLayer):
        def __init__(self, capacity: int):
            super().__init__()
            self.capacity, self.length = capacity, 0

        def lazy_initialization(self, key_states, value_states) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            b, _, _, _ = key_states.shape
            self.kbuf = key_states.new_empty((b, key_states.shape[1], self.capacity, key_states.shape[3]))
            self.vbuf = value_states.new_empty((b, value_states.shape[1], self.capacity, value_states.shape[3]))
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if end > self.capacity:
                raise RuntimeError(f"sampler cache: {end} positions in a buffer of {self.capacity}")
            self.kbuf[:, :, self.length:end] = key_states
            self.vbuf[:, :, self.length:end] = value_states
            self.length = end
            self.keys, self.values = self.kbuf[:, :, :end], self.vbuf[:, :, :end]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length

        def batch_select_indices(self, indices) -> None:
            if self.is_initialized:
                self.kbuf, self.vbuf = self.kbuf[indices], self.vbuf[indices]
                self.keys, self.values = self.kbuf[:, :, :self.length], self.vbuf[:, :, :self.length]

    return BufferLayer


class PrefixSampler:
    """Batched generation for one hf text chat model (see the module docstring)."""

    def __init__(self, eos_ids: list[int], pad_id: int, max_bytes: int):
        self.eos, self.pad = set(int(e) for e in eos_ids), int(pad_id)
        self.cache = PrefixCache(max_bytes)
        self.model = None
        self.alone_on_cpu = True  # `_alone`; off: one padded batch, as on a GPU
        self.costs = None  # (model, FLOPs per token, per attended pair, per call) for `_alone_pays`

    def generate(self, model, prompts: list[list[int]], params, seeds: list[int | None]):
        """(tokens, log-probs or None, stopped at eos) per prompt of `model` (the chat model's current module: a
        learner may swap it), the rows `_run_generate` gives."""
        import torch

        seeds = draw_seeds(seeds, params)
        self.model = model
        device = model.device
        rows = RowSampler(seeds if params.temperature > 0 else None, params, device)
        with torch.inference_mode():
            self.cache.check(weights_version(self.model))
            logits, cache, mask = self._prefill(prompts, params.max_new_tokens)
            return self._decode(logits, cache, mask, prompts, params, rows)

    # -------------------------------------------------------------- prefill
    def _prefill(self, prompts: list[list[int]], max_new: int):
        """Logits [B, V] at each prompt's last token, its cache (room for `max_new` more tokens) and attention mask
        [B, width]: each distinct prompt runs once, only past its cached prefix."""
        import torch
        from transformers.cache_utils import DynamicCache

        device = self.model.device
        unique = list(dict.fromkeys(tuple(p) for p in prompts))
        which = {p: i for i, p in enumerate(unique)}
        found = [self.cache.lookup(list(p)) for p in unique]
        hit = [len(f) * BLOCK for f in found]
        tails = [list(p[h:]) for p, h in zip(unique, hit)]
        cache = DynamicCache(config=self.model.config)
        buffered = _buffer_layer()
        if len(unique) > 1 and device.type == "cpu" and self.alone_on_cpu and self._alone_pays(hit, tails):
            # each row's prompt sits right-aligned in `width` columns, cached part and tail together
            width = max(len(p) for p in unique)
            lengths = torch.tensor([len(p) for p in unique], device=device)
            mask = (torch.arange(width, device=device) >= width - lengths[:, None]).long()
            cache.layers = [buffered(width + max_new) for _ in cache.layers]
            logits = self._alone(found, hit, tails, width, cache)
            column = lambda u, t: width - len(unique[u]) + t  # noqa: E731
        else:
            # one padded batch: every row's cached part right-aligned in h_max columns, its tail in the s_max after
            h_max, s_max = max(hit), max(len(t) for t in tails)
            cols = torch.arange(h_max + s_max, device=device)
            cached = torch.tensor(hit, device=device)[:, None]
            ran = torch.tensor([len(t) for t in tails], device=device)[:, None]
            mask = (((cols >= h_max - cached) & (cols < h_max)) | (cols >= h_max + s_max - ran)).long()
            cache.layers = [buffered(h_max + s_max + max_new) for _ in cache.layers]
            if h_max:
                past = self._past(found, h_max)  # [U, layers, 2, kv, h_max, d]
                for layer in range(past.shape[1]):
                    cache.update(past[:, layer, 0], past[:, layer, 1], layer)
            ids = torch.tensor([[self.pad] * (s_max - len(t)) + t for t in tails], device=device)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, h_max:]
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                             use_cache=True, logits_to_keep=1)
            logits, cache = out.logits[:, -1], out.past_key_values
            column = lambda u, t: (h_max - hit[u] + t if t < hit[u]  # noqa: E731
                                   else h_max + s_max - len(unique[u]) + t)
        self._store(unique, column, cache)
        group = torch.tensor([which[tuple(p)] for p in prompts], device=device)
        if len(unique) < len(prompts):
            cache.batch_select_indices(group)
        return logits[group], cache, mask[group]

    def _alone_pays(self, hit: list[int], tails: list[list[int]]) -> bool:
        """Whether running the distinct prompts one at a time costs less than one padded batch, counted in FLOPs
        with a forward's fixed cost added per call. A padded batch runs every row for the longest tail against the
        longest cached part plus that tail, so rows of mixed lengths waste much of it (a call of 16 eval prompts of
        the mini team ran as 680 query columns over 968 key columns for every row); one row alone runs its own
        tail only, without a mask when nothing is cached (the causal kernel skips the future)."""
        if self.costs is None or self.costs[0] is not self.model:
            config = self.model.config
            layers, heads = config.num_hidden_layers, config.num_attention_heads
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
            # FLOPs a token's matmuls cost (last-token logits excluded), of one query token attending to one key
            # token, and of a forward's fixed cost
            self.costs = (self.model, 2 * _layer_weights(self.model), 4 * layers * heads * head_dim,
                          CALL_FLOPS * layers)
        _, per_token, per_pair, per_call = self.costs
        h_max, s_max = max(hit), max(len(t) for t in tails)
        batched = len(tails) * s_max * (per_token + per_pair * (h_max + s_max))
        alone = sum(len(t) * (per_token + per_pair * (h + (len(t) / 2 if h == 0 else len(t))))
                    for h, t in zip(hit, tails))
        return alone + (len(tails) - 1) * per_call < batched

    def _alone(self, found: list[list], hit: list[int], tails: list[list[int]], width: int, cache):
        """Distinct prompts run one at a time, each on its own cached blocks (no padding; with nothing cached no
        mask either, so attention takes the causal kernel: 1.45x faster than one padded batch on 16 communicate
        prompts of the mini team), their keys and values joined right-aligned in `width` columns of `cache`.
        Returns the last-token logits [U, V]."""
        import torch
        from transformers.cache_utils import DynamicCache

        device = self.model.device
        logits, alone = [], []
        for blocks, h, t in zip(found, hit, tails):
            own = DynamicCache(config=self.model.config)
            if blocks:
                past = torch.cat(blocks, dim=3)  # [layers, 2, kv, h, d]
                for layer in range(past.shape[0]):
                    own.update(past[layer, 0][None], past[layer, 1][None], layer)
            out = self.model(input_ids=torch.tensor([t], device=device), past_key_values=own,
                             position_ids=torch.arange(h, h + len(t), device=device)[None], use_cache=True,
                             logits_to_keep=1)
            logits.append(out.logits[0, -1])
            alone.append(out.past_key_values)
        for i in range(len(cache.layers)):
            first = alone[0].layers[i]
            keys = first.keys.new_zeros((len(tails), first.keys.shape[1], width, first.keys.shape[3]))
            values = first.values.new_zeros((len(tails), first.values.shape[1], width, first.values.shape[3]))
            for u, c in enumerate(alone):
                n = hit[u] + len(tails[u])
                keys[u, :, width - n:] = c.layers[i].keys[0]
                values[u, :, width - n:] = c.layers[i].values[0]
            cache.update(keys, values, i)
        return torch.stack(logits)

    def _past(self, found: list[list], h_max: int):
        """The cached blocks of each distinct prompt joined and left-padded (zeros, masked) to h_max tokens."""
        import torch

        like = next(f[0] for f in found if f)
        layers, two, kv, _, d = like.shape
        past = torch.zeros((len(found), layers, two, kv, h_max, d), dtype=like.dtype, device=like.device)
        for i, blocks in enumerate(found):
            if blocks:
                past[i, :, :, :, h_max - len(blocks) * BLOCK:] = torch.cat(blocks, dim=3)
        return past

    def _store(self, unique, column, cache) -> None:
        """Every full block of each distinct prompt that ran, from the prefill's cache; `column(u, t)` is where
        token t of distinct prompt u sits in it."""
        import torch

        keys = [layer.keys for layer in cache.layers]
        values = [layer.values for layer in cache.layers]
        for u, prompt in enumerate(unique):
            row: list = []  # the row's [layers, 2, kv, width, d], made once it has a block to keep

            def kv_of(start: int, u: int = u, row: list = row):
                if not row:
                    row.append(torch.stack([torch.stack([k[u], v[u]]) for k, v in zip(keys, values)]))
                col = column(u, start)
                return row[0][:, :, :, col:col + BLOCK].clone()  # its own tensor: it keeps no buffer alive
            self.cache.store(list(prompt), kv_of)

    # -------------------------------------------------------------- decode
    def _decode(self, logits, cache, mask, prompts, params, rows):
        """Sample until every row has stopped at an eos or made max_new_tokens; finished rows leave the batch."""
        import torch

        n = len(prompts)
        device = logits.device
        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        stopped = [False] * n
        alive = list(range(n))
        gens = rows.generators
        positions = mask.sum(-1, keepdim=True) - 1  # [b, 1] of the last real token
        # a checkpoint's generation_config.min_new_tokens holds eos back, as transformers' generate does (before the
        # log-probs are taken, so they describe the policy that was sampled)
        hold = int(getattr(getattr(self.model, "generation_config", None), "min_new_tokens", None) or 0)
        eos = torch.tensor(sorted(self.eos), device=device)
        for step in range(params.max_new_tokens):
            if step < hold:
                logits = logits.index_fill(-1, eos, float("-inf"))
            scores, logp = rows.scores(logits, [gens[i] for i in alive] if gens is not None else None)
            chosen = scores.argmax(-1)
            lp = logp.gather(1, chosen[:, None]).squeeze(1).tolist() if logp is not None else None
            picked = chosen.tolist()
            keep = []
            for j, i in enumerate(alive):
                tokens[i].append(picked[j])
                if lp is not None:
                    logps[i].append(lp[j])
                if picked[j] in self.eos:
                    stopped[i] = True
                else:
                    keep.append(j)
            if not keep or step == params.max_new_tokens - 1:
                break
            if len(keep) < len(alive):
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                mask, positions, chosen = mask[index], positions[index], chosen[index]
                alive = [alive[j] for j in keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions + 1
            out = self.model(input_ids=chosen[:, None], attention_mask=mask, position_ids=positions,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits, cache = out.logits[:, -1], out.past_key_values
        return tokens, (logps if rows.want_logprobs else None), stopped
