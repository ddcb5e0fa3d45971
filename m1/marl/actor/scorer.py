"""How one agent's learner scores its samples: token rows, the images of vision-language prompts, and every path
that computes a completion's log-probs.

A learner (m1/marl/actor/learner.py) owns one `Scorer` over its chat model. The scorer turns samples (and SFT examples)
into the (prompt, completion) token rows the update trains on, decodes the frames of multimodal prompts again from
their video, and computes per-token log-probs [B, C] with their mask through one of four passes that give the same
values: the joint pass over prompt + completion; the shared-prompt pass, each distinct prompt once and its key/value
cache reused by its completions (GRPO's K rollouts share a prompt); the detached-prompt pass of
`learner.prompt_grad: false`; and the whole-sequence pass of SFT's prompt loss. Policy, reference and probe all
score through it, so they see the same rows, positions and images.

Vision-language policies (a seed kind's `interface: vision` Qwen2-VL / Qwen2.5-VL model, backend hf): a sample's
prompt ids keep the processor's image-pad tokens, and the forward pass gets the `pixel_values` / `image_grid_thw` of its frames,
decoded again from the sample's video and frame indices (samples and traces never hold pixels). The model then
places its own multimodal rotary positions, so such prompts take the joint pass (no prompt sharing) and are never
cut: a prompt over `max_prompt_tokens` is an error. Policy, reference and sampler all score with the same images.
"""
from __future__ import annotations

from typing import Any

from m1.evidence import chat_token_evidence
from m1.marl.config import LearnerConfig
from m1.marl.algo.reductions import token_logprobs
from m1.marl.rollout.episodes import Sample
from m1.models.base import ChatRequest, image_frames, text_only
from m1.video import VideoPool


class Scorer:
    """Token rows, images and log-probs of one learner's samples, on its chat model (`chat`, whose `model` is the
    policy). `engine` is the learner's DeepSpeed engine once built: a prompt's cache is never carried through it."""

    def __init__(self, agent: str, chat, cfg: LearnerConfig, vl: bool):
        self.agent, self.chat, self.cfg, self.vl = agent, chat, cfg, vl
        self.tokenizer, self.device = chat.tokenizer, chat.device
        self.engine = None
        self._videos: VideoPool | None = None  # opened on the first multimodal sample

    # -------------------------------------------------------------- samples
    def sft_sample(self, ex) -> Sample:
        """An SFT example (m1/marl/sft.py) as this learner's `Sample`: its own chat rendering and tokenizer; the
        target ends with end-of-turn."""
        tok = self.tokenizer
        if self.vl:  # the frames stay images: the prompt ids carry their image-pad tokens
            frames = image_frames(ex.messages)
            video = getattr(ex, "video", None)
            if frames and not video:
                raise ValueError(f"agent {self.agent!r}: SFT example of question {ex.question_id!r} has "
                                 f"{len(frames)} image parts but no `video`; a vision-language student needs it "
                                 "(prepare the examples again)")
            text, _ = self.chat.render_chat(ex.messages)
            images = self._decode(video, frames) if frames else None
            prompt = self.chat.processor(text=[text], images=images, return_tensors="np")["input_ids"][0].tolist()
            completion = tok(ex.completion, add_special_tokens=False)["input_ids"] + [self.chat.eos_ids[0]]
            return Sample(agent=self.agent, question_id=ex.question_id, group=0, rollout=0, phase=ex.phase,
                          prompt_ids=prompt, completion_ids=list(completion), logprobs=None, reward=0.0,
                          advantage=0.0, temperature=1.0, video=video if frames else None, frames=frames or None)
        # a seed-kind chat carries image parts: the text model sees them as placeholders, as when it generates
        # (m1/team/single.py); plain-string CPP chats render exactly as before
        messages = text_only(ex.messages)
        text = self.chat.render(ChatRequest(messages))
        evidence = getattr(ex, "evidence", None) if self.cfg.attention.on else None
        prompt = tok(text, add_special_tokens=False, return_offsets_mapping=bool(evidence))
        reply = tok(ex.completion, add_special_tokens=False, return_offsets_mapping=bool(evidence))
        completion = reply["input_ids"] + [self.chat.eos_ids[0]]
        rows = None
        if evidence:
            try:
                rows = chat_token_evidence(text, [m.get("content") or "" for m in messages],
                                           prompt["offset_mapping"], ex.completion, reply["offset_mapping"],
                                           evidence, tail=1)
            except ValueError as exc:
                raise ValueError(f"agent {self.agent!r}: SFT example of question {ex.question_id!r} "
                                 f"({ex.phase}): {exc}") from exc
        return Sample(agent=self.agent, question_id=ex.question_id, group=0, rollout=0, phase=ex.phase,
                      prompt_ids=list(prompt["input_ids"]), completion_ids=list(completion), logprobs=None,
                      reward=0.0, advantage=0.0, temperature=1.0, evidence=rows)

    # -------------------------------------------------------------- images (vision-language policies)
    def _decode(self, video: str, frames: list[int]):
        """The frames as the team decoded them for the prompt (same reader, same indices)."""
        if self._videos is None:
            self._videos = VideoPool(max_bytes=256 << 20)
        return list(self._videos.open(video).frames(frames))

    def vision_inputs(self, samples: list[Sample]) -> dict[str, Any] | None:
        """The `pixel_values` / `image_grid_thw` of the samples' prompts, in row order (the model fills the
        image-pad tokens of the batch in that order); None for a text learner or prompts without images.

        Checks each prompt's image-pad count against its images, so a prompt cut short or a frame list that does
        not belong to it is an error rather than a silently misplaced image."""
        import torch

        if not self.vl:
            return None
        images, counts = [], []
        for s in samples:
            if s.frames and not s.video:
                raise ValueError(f"agent {self.agent!r}: sample of question {s.question_id!r} has frames but no video")
            got = self._decode(s.video, s.frames) if s.frames else []
            images += got
            counts.append(len(got))
        if not images:
            return None
        inputs = self.chat.image_inputs(images)
        config = self.chat.model.config
        pad_id = config.image_token_id
        merge = self.chat.processor.image_processor.merge_size ** 2
        per_image = (inputs["image_grid_thw"].prod(-1) // merge).tolist()
        start = 0
        for s, n in zip(samples, counts):
            want = int(sum(per_image[start:start + n]))
            start += n
            have = sum(t == pad_id for t in s.prompt_ids)
            if have != want:
                raise ValueError(f"agent {self.agent!r}: sample of question {s.question_id!r} ({s.phase}) has {have} "
                                 f"image-pad tokens but its {n} frames make {want}")
        inputs["image_grid_thw"] = inputs["image_grid_thw"].to(torch.long)
        return inputs

    # -------------------------------------------------------------- scoring
    def rows(self, samples: list[Sample]) -> list[tuple[list[int], list[int]]]:
        """(prompt, completion) ids; completions cut to `learner.max_completion_tokens` (the rest is not trained).

        A prompt is never cut (a cut loses its head: the system prompt, the question and its options): one longer
        than `learner.max_prompt_tokens` is an error naming the agent, question and phase (the team's prompt budget,
        m1/team/budget.py, keeps rollouts within it)."""
        p_max, c_max = self.cfg.max_prompt_tokens, self.cfg.max_completion_tokens
        for s in samples:
            if len(s.prompt_ids) > p_max:
                raise ValueError(f"agent {self.agent!r}: a prompt of {len(s.prompt_ids)} tokens (question "
                                 f"{s.question_id!r}, {s.phase}) exceeds learner.max_prompt_tokens={p_max}; prompts "
                                 "are never cut: raise it, or keep the team's limits.max_prompt_tokens within it")
        return [(s.prompt_ids, s.completion_ids[:c_max]) for s in samples]

    def completion_logprobs(self, model, rows: list[tuple[list[int], list[int]]], temperature: float | list[float],
                            vision: dict[str, Any] | None = None):
        """Log-probs [B, C] of each completion token given its prompt, and the mask [B, C] of real tokens.

        Prompts are left-padded and completions right-padded so all completions start at one column; positions
        count real tokens only (as `generate` does with left padding), so the values match the sampler's.
        GRPO's K completions of a question share one prompt: when rows repeat prompts (and `share_prompt_forward`
        is on), each distinct prompt is run once and its key/value cache is reused by its completions.
        `vision` (from `vision_inputs` of the same rows) feeds the images of multimodal prompts.
        """
        if vision is not None or self.vl:
            return self._joint_logprobs(model, rows, temperature, vision)
        prompts = list(dict.fromkeys(tuple(p) for p, _ in rows))
        longest = max(len(c) for _, c in rows)
        if (not self.cfg.prompt_grad and model.training and longest > 0 and min(len(p) for p in prompts) > 1
                and self._can_share_prompt(model)):
            return self._detached_prompt_logprobs(model, rows, [list(p) for p in prompts], temperature)
        if (self.cfg.share_prompt_forward and len(prompts) < len(rows) and longest > 0
                and self._can_share_prompt(model)):
            return self._shared_prompt_logprobs(model, rows, [list(p) for p in prompts], temperature)
        return self._joint_logprobs(model, rows, temperature)

    def _joint_logprobs(self, model, rows: list[tuple[list[int], list[int]]], temperature: float | list[float],
                        vision: dict[str, Any] | None = None):
        """One forward over prompt + completion for every row (no sharing). A vision-language model is given no
        position ids: it derives its multimodal rotary positions from the ids, the image grids and the mask, as
        `generate` does."""
        starts = [len(p) for p, _ in rows]
        if not self.vl and max(starts) - min(starts) <= max(len(c) for _, c in rows):
            return self._right_padded_logprobs(model, rows, temperature)  # few columns score completions (see there)
        input_ids, attention, cmask, p_len, c_len = self.padded_rows(rows)
        if self.vl and vision is not None:
            # Only the prompts' image pads take image features and 3D positions. A sampled reply may hold an image-
            # or video-pad token too (a random policy does): the sampler embedded it as text, so here it is hidden
            # from the placement (`placed`) while the text embeddings come from the true ids.
            config = self.chat.model.config
            placed = input_ids.clone()
            reply = placed[:, p_len:]
            reply[(reply == config.image_token_id) | (reply == config.video_token_id)] = self.tokenizer.pad_token_id
            types = (placed == config.image_token_id).int() + 2 * (placed == config.video_token_id).int()
            embeds = getattr(model, "module", model).get_input_embeddings()(input_ids)
            out = model(input_ids=placed, inputs_embeds=embeds, attention_mask=attention, mm_token_type_ids=types,
                        logits_to_keep=c_len + 1, use_cache=False, **vision)
        elif self.vl:  # no images: the model's own (text) positions
            out = model(input_ids=input_ids, attention_mask=attention, logits_to_keep=c_len + 1, use_cache=False)
        else:
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                        logits_to_keep=c_len + 1, use_cache=False)
        logits = out.logits[:, :-1]  # the logits at column P-1+t score completion token t
        logp = token_logprobs(logits, input_ids[:, p_len:], temperature)
        return logp, cmask

    def _right_padded_logprobs(self, model, rows: list[tuple[list[int], list[int]]],
                               temperature: float | list[float]):
        """`_joint_logprobs` of a text model with each row's prompt + completion from column 0 and the padding after
        it. Causal attention never reaches a later pad from a real token, so no mask is passed and attention takes
        the causal kernel, which skips the future (a left-padded batch needs an explicit mask, and the kernel then
        runs every query against every key). Logits are made only at the columns that score a completion token of
        some row (the union of `len(prompt) - 1 + t`), so it is taken when the prompts' lengths differ by at most the
        longest completion (length-sorted micro-batches mostly do): else that union would hold more columns than the
        left-padded pass's C + 1 logits by far. Same values as the left-padded pass."""
        import torch

        pad = self.tokenizer.pad_token_id
        c_len = max(len(c) for _, c in rows)
        if c_len == 0:
            empty = torch.zeros((len(rows), 0), device=self.device)
            return empty, empty
        width = max(len(p) for p, _ in rows) + c_len
        ids = torch.tensor([p + c + [pad] * (width - len(p) - len(c)) for p, c in rows], device=self.device)
        cmask = torch.tensor([[1.0] * len(c) + [0.0] * (c_len - len(c)) for _, c in rows], device=self.device)
        starts = torch.tensor([len(p) - 1 for p, _ in rows], device=self.device)  # the column scoring token 0
        cols = starts[:, None] + torch.arange(c_len, device=self.device)[None]     # [B, C]
        keep = torch.unique(cols)  # sorted
        out = model(input_ids=ids, logits_to_keep=keep, use_cache=False)
        logits = out.logits[torch.arange(len(rows), device=self.device)[:, None], torch.searchsorted(keep, cols)]
        return token_logprobs(logits, ids.gather(1, cols + 1), temperature), cmask

    def padded_rows(self, rows: list[tuple[list[int], list[int]]]):
        """(input ids, attention mask, completion mask [B, C], P, C) of rows joined as prompt + completion, prompts
        left-padded and completions right-padded to the longest, so every completion starts at column P."""
        import torch

        pad = self.tokenizer.pad_token_id
        p_len = max(len(p) for p, _ in rows)
        c_len = max(len(c) for _, c in rows)
        ids, attn, cmask = [], [], []
        for p, c in rows:
            lp, rc = p_len - len(p), c_len - len(c)
            ids.append([pad] * lp + p + c + [pad] * rc)
            attn.append([0] * lp + [1] * (len(p) + len(c)) + [0] * rc)
            cmask.append([1.0] * len(c) + [0.0] * rc)
        return (torch.tensor(ids, device=self.device), torch.tensor(attn, device=self.device),
                torch.tensor(cmask, device=self.device), p_len, c_len)

    def sequence_logprobs(self, model, rows: list[tuple[list[int], list[int]]], prompt: bool = True):
        """One left-padded forward over prompt + completion (for `learner.prompt_loss` and the evidence attention
        loss, whose rows are the padded batch's columns). Returns the completion's log-probs and mask [B, C] (as
        `completion_logprobs` at temperature 1) and, with `prompt`, the prompt's [B, P-1] from every column's
        logits (token j of a left-padded prompt scored from the logits at j-1; a row's first token is not scored);
        without it (the attention loss alone) logits are made at the completion's columns only, and the prompt's
        log-probs and mask are None."""
        if self.vl:
            raise ValueError(f"agent {self.agent!r}: learner.prompt_loss is for text students; a vision-language "
                             "prompt's image-pad tokens are not text to predict (set it to 0)")
        input_ids, attention, cmask, p_len, c_len = self.padded_rows(rows)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        if not prompt:
            out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                        logits_to_keep=c_len + 1, use_cache=False)
            return token_logprobs(out.logits[:, :-1], input_ids[:, p_len:], 1.0), cmask, None, None
        out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=False)
        logp = token_logprobs(out.logits[:, :-1], input_ids[:, 1:], 1.0)  # column j scores token j+1
        # prompt token j (j >= 1) is scored at column j-1 when both it and the token before it are real
        p_mask = (attention[:, 1:p_len] * attention[:, :p_len - 1]).float()
        return logp[:, p_len - 1:], cmask, logp[:, :p_len - 1], p_mask

    def _can_share_prompt(self, model) -> bool:
        """Whether a prompt's cache can be carried into a second forward with gradient intact.

        Not through a DeepSpeed engine: each engine forward hooks its outputs to run the engine's backward
        prologue (ZeRO `enter_backward`, callback queueing), so with the prompt pass's cache feeding the completion
        pass the prologue runs twice in one backward. On one CPU rank (ZeRO-2, fp32) the gradients still match the
        joint pass, but multi-rank reduction under a doubled prologue is untested, so the engine keeps the joint
        pass. Not with gradient checkpointing in training (the layers drop the cache), nor with sliding-window
        layers (their cache is cut to the window).
        """
        if self.engine is not None and model is self.engine:
            return False
        if self.cfg.gradient_checkpointing and model.training:
            return False
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = base.config
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            return all(t == "full_attention" for t in layer_types)
        return not getattr(config, "use_sliding_window", False)

    def _shared_prompt_logprobs(self, model, rows: list[tuple[list[int], list[int]]], prompts: list[list[int]],
                                temperature: float | list[float]):
        """`_joint_logprobs` computed with one forward per distinct prompt and one over the completions.

        Pass 1 runs the U distinct prompts (left-padded) with a cache, under the caller's grad mode, so gradient
        reaches the prompt's keys and values exactly as in the joint pass; its last column scores completion
        token 0. The cache is then gathered to the B rows (the gather's backward sums the K rows' gradients back
        into their shared prompt). Pass 2 runs completion tokens 0..C-2 (right-padded) on that cache, with the
        attention mask [prompt mask, completion mask] and positions continuing after each prompt's real tokens;
        its logits score tokens 1..C-1.
        """
        import torch
        from transformers.cache_utils import DynamicCache, DynamicLayer

        pad = self.tokenizer.pad_token_id
        which = {tuple(p): i for i, p in enumerate(prompts)}
        group = torch.tensor([which[tuple(p)] for p, _ in rows], device=self.device)
        p_len = max(len(p) for p in prompts)
        c_len = max(len(c) for _, c in rows)
        p_ids = torch.tensor([[pad] * (p_len - len(p)) + p for p in prompts], device=self.device)
        p_attn = torch.tensor([[0] * (p_len - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        c_ids = torch.tensor([c + [pad] * (c_len - len(c)) for _, c in rows], device=self.device)
        c_attn = torch.tensor([[1] * len(c) + [0] * (c_len - len(c)) for _, c in rows], device=self.device)

        out = model(input_ids=p_ids, attention_mask=p_attn, position_ids=(p_attn.cumsum(-1) - 1).clamp(min=0),
                    logits_to_keep=1, use_cache=True)
        first = token_logprobs(out.logits[group], c_ids[:, :1], temperature)  # [B, 1]
        if c_len == 1:
            return first, c_attn.float()
        cache = out.past_key_values
        if not isinstance(cache, DynamicCache) or any(type(layer) is not DynamicLayer or
                                                      layer.get_seq_length() != p_len for layer in cache.layers):
            raise RuntimeError(f"agent {self.agent!r}: the prompt pass returned {type(cache).__name__} "
                               f"({[type(layer).__name__ for layer in getattr(cache, 'layers', [])][:3]}...), "
                               f"not a full-attention DynamicCache of {p_len} tokens; set "
                               "learner.share_prompt_forward: false for this model")
        cache.batch_select_indices(group)
        attention = torch.cat([p_attn[group], c_attn[:, :-1]], dim=1)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)[:, p_len:]
        out = model(input_ids=c_ids[:, :-1], attention_mask=attention, position_ids=positions,
                    past_key_values=cache, use_cache=True)
        rest = token_logprobs(out.logits, c_ids[:, 1:], temperature)  # [B, C-1]
        return torch.cat([first, rest], dim=1), c_attn.float()

    def _detached_prompt_logprobs(self, model, rows: list[tuple[list[int], list[int]]], prompts: list[list[int]],
                                  temperature: float | list[float]):
        """Log-probs for `learner.prompt_grad: false`: each distinct prompt but its last token runs once without
        gradient; the completion pass (the prompt's last token, then completion tokens 0..C-2) runs on that cache
        with gradient, so every completion token is scored by a pass that has one, while the prompt's keys and
        values are constants. Same values as the joint pass, a different (cheaper) gradient."""
        import torch

        pad = self.tokenizer.pad_token_id
        which = {tuple(p): i for i, p in enumerate(prompts)}
        group = torch.tensor([which[tuple(p)] for p, _ in rows], device=self.device)
        heads = [p[:-1] for p in prompts]
        h_len = max(len(h) for h in heads)
        c_len = max(len(c) for _, c in rows)
        h_ids = torch.tensor([[pad] * (h_len - len(h)) + h for h in heads], device=self.device)
        h_attn = torch.tensor([[0] * (h_len - len(h)) + [1] * len(h) for h in heads], device=self.device)
        with torch.no_grad():
            out = model(input_ids=h_ids, attention_mask=h_attn, position_ids=(h_attn.cumsum(-1) - 1).clamp(min=0),
                        logits_to_keep=1, use_cache=True)
        cache = out.past_key_values
        cache.batch_select_indices(group)
        last = [prompts[which[tuple(p)]][-1] for p, _ in rows]
        c_ids = torch.tensor([c + [pad] * (c_len - len(c)) for _, c in rows], device=self.device)
        c_attn = torch.tensor([[1] * len(c) + [0] * (c_len - len(c)) for _, c in rows], device=self.device)
        step_ids = torch.cat([torch.tensor(last, device=self.device)[:, None], c_ids[:, :-1]], dim=1)
        attention = torch.cat([h_attn[group], torch.ones_like(c_attn[:, :1]), c_attn[:, :-1]], dim=1)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)[:, h_len:]
        out = model(input_ids=step_ids, attention_mask=attention, position_ids=positions, past_key_values=cache,
                    use_cache=True)
        return token_logprobs(out.logits, c_ids, temperature), c_attn.float()

    def padded(self, values: list[list[float] | None], width: int):
        """Per-token values (sampled log-probs, token advantages) as [B, width]: each row cut or 0-padded."""
        import torch

        rows = []
        for v in values:
            if v is None:
                raise ValueError(f"agent {self.agent!r}: grpo.old_logprobs=rollout needs the sampler's log-probs")
            v = list(v[:width])
            rows.append(v + [0.0] * (width - len(v)))
        return torch.tensor(rows, device=self.device, dtype=torch.float32)
