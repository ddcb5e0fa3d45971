"""Tiny random models built offline, saved to disk and loaded through the real loading path.

No model hub is reachable here, yet tests and smoke runs need chat, vision and CLIP models that
go through exactly the code real checkpoints use. So we train a small byte-level BPE on a
built-in corpus, build random Qwen2 / Qwen3 / Qwen2.5-VL / open_clip models from small configs,
save them like a hub snapshot, and hand back the folder.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from m1.config import TinySpec
from m1.files import disk_errors
from m1.models.base import ModelError
from m1.registry import PAPER_TOOLS

# Bump when the recipe below changes, so old cache folders are not reused by mistake.
RECIPE_VERSION = 1

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# Qwen-style ChatML: string content or a list of text/image/video parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOOLS = list(PAPER_TOOLS)  # the paper's eight only: the vocabulary (the cache key) stays put as others register
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black", "grey", "pink"]
SHAPES = ["square", "circle", "triangle", "star", "disc", "rectangle", "ring", "cross"]


def _default_corpus() -> list[str]:
    """Sentences in the register of M1 prompts, so typical prompts become short token runs."""
    lines = [
        "You are an agent in a team that answers questions about a video.",
        "Read the question and the options, then plan which tools to use.",
        "Write the key information you need and the tools you will call.",
        "Each tool returns a short text that is stored in the shared memory.",
        "Look at what the other agents found before you decide.",
        "If the memory already holds enough evidence, continue without a new tool.",
        "Otherwise add one more tool and say what key information it should find.",
        "Answer with one option letter and give a short reason.",
        "The video is long; sample frames uniformly to get an overview.",
        "Find the clip that matches the question best and browse it closely.",
        "Question: What colour is the shape that appears first in the video?",
        "Question: How many times does the circle cross the screen?",
        "Question: Which object is to the left of the blue square?",
        "Question: When does the red triangle disappear? Give the time span.",
        "Question: What happens after the scene changes?",
        "Options: (A) red (B) green (C) blue (D) yellow",
        "Options: A. 1 B. 2 C. 3 D. 4",
        "##key info: the colour of the first shape and when it appears",
        "##key info: the number of crossings of the circle",
        "##tool use: <Video Retrieval>, <Rough Browser>",
        "##tool use: <Global Sampling>, <Fine Browser>",
        "##tool use: <Time Stamp Retrieval>, <Space Tool>",
        "##tool use: <Image Retrieval>, <Grounding Tool>",
        "##tool call: continue()",
        "##tool call: add tool <Fine Browser>",
        "##Answer: B ##Reason: the rough browser saw a green square at the start.",
        "##Answer: A ##Reason: the memory of every agent agrees on the red circle.",
        "##Answer: D ##Reason: the fine browser counted four crossings.",
        "##Final Answer: C ##Reason Summary: most agents saw the blue star on the left.",
        "##Timestamp: [12.5 - 30.0]",
        "##Timestamp: [0.0 - 4.5]",
        "Summary: a yellow disc moves from left to right, then a purple ring appears.",
        "The frames were taken at 0.0, 2.5, 5.0, 7.5 and 10.0 seconds.",
        "Describe what you see in these frames in at most two sentences.",
        "The scene changes at 01:30 and the background turns dark.",
        "Time 00:00:15, 00:01:00, 00:02:45, 00:10:30.",
        "Tool error: the focus is empty, select frames first.",
        "system user assistant",
    ]
    for t in TOOLS:
        lines.append(f"<{t}> is a tool. Call {t} when it helps; the {t} output goes to memory.")
    for c in COLOURS:
        for s in SHAPES:
            lines.append(f"a {c} {s} moves left, right, up and down; the {c} {s} is on the left.")
    lines.append(" ".join(str(i) for i in range(0, 101)))
    lines.append(" ".join(f"{m:02d}:{s:02d}" for m in range(0, 60, 7) for s in range(0, 60, 15)))
    lines.append(" ".join(f"{x}.{y}" for x in range(0, 40, 3) for y in (0, 5)))
    return lines


# Qwen2's pre-tokenizer split (words, single digits, punctuation runs, newlines). transformers loads any
# folder whose config says `qwen2` with its Qwen2Tokenizer class, which imposes this split whatever the
# saved tokenizer.json says; training the BPE on the same split keeps the merges valid for every arch.
QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
              r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def build_tokenizer(corpus: list[str] | None = None, vocab_size: int = 1024, qwen_split: bool = False,
                    train_split: str | None = None, repeat: int = 4):
    """Train a byte-level BPE with Qwen-style special tokens and chat template (deterministic).

    `qwen_split`: pre-tokenize (and normalise, NFC) exactly as transformers' Qwen2Tokenizer does, so
    the trained merges survive loading the tokenizer through a qwen2 model folder. `train_split` (with
    `qwen_split`): learn the merges on pieces cut by this finer regex instead, then pre-tokenize by Qwen's;
    no merge crosses a border the finer split draws. `repeat`: how often the corpus is fed.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(corpus) if corpus is not None else _default_corpus()
    if not texts:
        raise ModelError("build_tokenizer: the corpus is empty")
    def split(regex: str):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])

    bpe = Tokenizer(models.BPE())
    if qwen_split:
        bpe.normalizer = normalizers.NFC()
        bpe.pre_tokenizer = split(train_split or QWEN_SPLIT)
    else:
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    # Repeat the corpus so frequent words win merges over one-off strings.
    bpe.train_from_iterator(texts * repeat, trainer)
    if qwen_split and train_split:
        bpe.pre_tokenizer = split(QWEN_SPLIT)  # what transformers' Qwen2Tokenizer applies anyway
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token=None,
                                  additional_special_tokens=SPECIAL_TOKENS[1:],
                                  padding_side="left")
    tok.chat_template = CHAT_TEMPLATE
    return tok


# ------------------------------------------------------------------------------------------ synth corpus
# Bump when the corpus or tokenizer recipe below changes: the tokenizer folder name carries it. Skip 3: it named
# the digit trial (synth_tokenizer), whose folder may still sit in a cache.
SYNTH_CORPUS_VERSION = 2
# each corpus's recipe version (the tokenizer folder and the model hashes carry it)
CORPUS_VERSIONS = {"synth": SYNTH_CORPUS_VERSION, "seed_kinds": 1, "reading": 1}
SYNTH_VOCAB = 4096  # BPE over Qwen-split words; this corpus has fewer distinct pieces than that
PHRASE_VOCAB = 8192  # the line-level BPE that proposes multi-word phrases
PHRASE_MIN_COUNT = 8
# The mini team's agent names and browser token budgets (configs/team/mini.yaml): the corpus run uses
# the same, so the lines the mini agents read most often become single tokens.
SYNTH_AGENTS = ("qwen3_big", "qwen3_small", "qwen2_big", "qwen2_small")
SYNTH_BROWSER_TOKENS = 40


def mine_phrases(texts: list[str], vocab_size: int = PHRASE_VOCAB, min_count: int = PHRASE_MIN_COUNT) -> list[str]:
    """Multi-word phrases that recur in `texts` (prompt boilerplate), to become single added tokens.

    A BPE whose merges may cross spaces (text split at newlines only) finds the recurring chunks; a
    chunk is kept when it has >= 2 words, no digit, no trailing answer letter, occurs >= `min_count`
    times and every occurrence starts and ends on a word boundary (so it never cuts a word).
    """
    import re

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    seen: dict[int, list[int]] = {}
    for enc, text in zip(bpe.encode_batch(texts), texts):
        for tid, (s, e) in zip(enc.ids, enc.offsets):
            piece = text[s:e]
            left = s == 0 or not (text[s - 1].isalnum() and piece[:1].isalnum())
            right = e == len(text) or not (text[e].isalnum() and piece[-1:].isalnum())
            st = seen.setdefault(tid, [0, 0])
            st[0] += 1
            st[1] += left and right
    letter_end = re.compile(r"(^|[\s:(])[A-Z]\W*$")
    out = []
    for tid, (n, aligned) in seen.items():
        piece = bpe.decode([tid])
        if (n >= min_count and aligned == n and len(piece.split()) >= 2 and "\n" not in piece
                and not any(c.isdigit() for c in piece) and not letter_end.search(piece)):
            out.append(piece)
    return sorted(set(out), key=lambda p: (-len(p), p))


# "01:15" as one token, and the numbers 10-120 (Qwen's split would cut every number into single digits)
WHOLE_NUMBERS = [f"{m:02d}:{s:02d}" for m in range(21) for s in range(60)] + [str(i) for i in range(10, 121)]


def synth_tokenizer(texts: list[str]):
    """Words by Qwen's split (valid for every arch), plus recurring phrases, clock times, agent tags as tokens.

    Clock times and the numbers 10-120 are single tokens here, unlike Qwen's tokenizers, which split every number
    into digits: it keeps the students' prompts short. Digits were tried (version 3, 2026-11-25): answer prompts
    grew by a third (555 -> 742 tokens on average), an SFT step took twice as long, and the team was no better
    (held-out SFT 50.5 +- 2.7 against 51.5 +- 1.3; docs/mini_team_history.md).
    """
    from tokenizers import AddedToken

    tok = build_tokenizer(texts, vocab_size=SYNTH_VOCAB, qwen_split=True)
    extra = mine_phrases(texts) + WHOLE_NUMBERS + [f"[{a}]" for a in SYNTH_AGENTS]
    tok.add_tokens([AddedToken(p, normalized=False, special=False) for p in extra])
    return tok


# The students' tokenizer: words are never merged with each other, with punctuation or with digits. A BPE trained on
# pieces split this way (letters with at most one leading space; one digit; a punctuation run with at most one
# leading space; whitespace) learns no merge across those borders, so loading it under Qwen's split (which qwen2
# folders impose) cuts the same tokens.
WORD_SPLIT = r""" ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s*[\r\n]+|\s+(?!\S)|\s+"""
READING_VOCAB = 8192  # more than the corpus's distinct pieces: every word it holds becomes one token


def reading_tokenizer(texts: list[str], apart: frozenset[str] = frozenset()):
    """The students' tokenizer: every word of the corpus one token (with its leading space), punctuation apart, the
    numbers 10-120 and clock times whole, so that a lookup matches the same tokens in the question, the options, a
    caption, a tool note and the memory.

    Recurring phrases become single tokens only when none of their words is in `apart` (the world's lookup words:
    colours, shapes, positions, motions): boilerplate such as a system prompt's sentences stays short, while
    `A: bottom left` or `white square` stay words. `synth_tokenizer` merges both kinds.
    """
    import re

    from tokenizers import AddedToken

    if not texts:
        raise ModelError("reading_tokenizer: the corpus is empty")
    tok = build_tokenizer(texts, vocab_size=READING_VOCAB, qwen_split=True, train_split=WORD_SPLIT, repeat=1)
    phrases = [p for p in mine_phrases(texts) if not {w.lower() for w in re.findall(r"[A-Za-z]+", p)} & apart]
    tok.add_tokens([AddedToken(p, normalized=False, special=False) for p in phrases + WHOLE_NUMBERS])
    return tok


# Corpora that need a world to write them, found by name so that models never import the synthetic world
# (as the hub finds backends): corpus name -> (module, function(workdir) -> list of texts, tokenizer recipe, the
# module's set of words the recipe keeps apart or None)
CORPORA: dict[str, tuple[str, str, Any, str | None]] = {
    "synth": ("m1.synth.corpus", "synth_corpus", synth_tokenizer, None),
    "seed_kinds": ("m1.synth.corpus", "seed_kinds_corpus", synth_tokenizer, None),
    "reading": ("m1.synth.corpus", "seed_kinds_corpus", reading_tokenizer, "LOOKUP_WORDS")}


def build_corpus_tokenizer(name: str, workdir: Path):
    """The tokenizer of corpus `name` (CORPORA): its texts written in `workdir`, then its recipe."""
    import importlib

    module_name, fn, recipe, apart = CORPORA[name]
    module = importlib.import_module(module_name)
    texts = getattr(module, fn)(workdir)
    return recipe(texts, frozenset(getattr(module, apart))) if apart else recipe(texts)


def ensure_synth_tokenizer(root: Path, corpus: str = "synth") -> Path:
    """The folder of the M1-Synth tokenizer of `corpus` (CORPORA) under `root`, built once and shared by every model."""
    from transformers import AutoTokenizer  # noqa: F401  (fail early if transformers is missing)

    final = Path(root) / f"tokenizer-{corpus}-v{CORPUS_VERSIONS[corpus]}"
    if (final / "tokenizer_config.json").is_file():
        return final
    Path(root).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        with disk_errors(tmp):
            tok = build_corpus_tokenizer(corpus, tmp / "world")
            shutil.rmtree(tmp / "world")
            tok.save_pretrained(tmp)
        _publish(tmp, final, "tokenizer_config.json")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _publish(tmp: Path, final: Path, marker: str) -> None:
    """Rename a finished build into place. If another process finished first, keep theirs; a
    stale folder without `marker` (an unfinished build) is replaced."""
    try:
        os.rename(tmp, final)
    except OSError:
        if (final / marker).is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            return
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)


def _tokenizer_for(spec: TinySpec, root: Path):
    if spec.corpus in CORPORA:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(ensure_synth_tokenizer(root, spec.corpus), local_files_only=True)
        tok.padding_side = "left"
        return tok
    return build_tokenizer()


def default_cache_dir() -> Path:
    return Path(os.environ.get("M1_CACHE") or Path.home() / ".cache" / "m1") / "tiny"


def spec_hash(spec: TinySpec) -> str:
    fields = spec.model_dump()
    if fields.get("corpus") == "default":  # keeps the hashes (cache folders) of specs older than the field
        fields.pop("corpus")
    if fields.get("init_std") is None:  # the same for init_std
        fields.pop("init_std", None)
    if fields.get("corpus") == "synth":  # the model folder holds a copy of that tokenizer
        fields["synth_tokenizer"] = SYNTH_CORPUS_VERSION
    elif fields.get("corpus") in CORPUS_VERSIONS:
        fields["corpus_tokenizer"] = CORPUS_VERSIONS[fields["corpus"]]
    payload = json.dumps({"recipe": RECIPE_VERSION, **fields}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def clip_config_name(spec: TinySpec) -> str:
    """The open_clip model name under which a tiny CLIP config is registered."""
    return f"m1-tiny-clip-{spec_hash(spec)}"


def ensure_tiny(spec: TinySpec, cache_dir: Path | None = None) -> Path:
    """Return the folder of the tiny model for `spec`, building it once (atomically) if missing."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"{spec.arch}-{spec_hash(spec)}"
    if (final / "m1_tiny.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        builders = {"qwen2": _build_text, "qwen3": _build_text, "qwen2_5_vl": _build_vl,
                    "open_clip": _build_clip}
        import torch

        # seeded from the spec without touching the caller's random state: a run that builds its models on first
        # use then draws the same random numbers as a run that finds them cached
        with torch.random.fork_rng(devices=[]), disk_errors(tmp):
            builders[spec.arch](spec, tmp)
        # The marker is written last: a folder without it is an unfinished build.
        (tmp / "m1_tiny.json").write_text(json.dumps(
            {"recipe": RECIPE_VERSION, "spec": spec.model_dump()}, indent=2, sort_keys=True))
        _publish(tmp, final, "m1_tiny.json")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


# With the usual 0.02 a tiny random model repeats one token forever; 0.2 gives varied outputs,
# so tests comparing batched and single generation compare something. A spec's `init_std` overrides it.
INIT_STD = 0.2
# what students trained from scratch start from (`m1 pretrain`'s bases): the usual transformer init
STUDENT_INIT_STD = 0.02


def _intermediate(spec: TinySpec) -> int:
    return spec.intermediate_size or 2 * spec.hidden_size


def _head_dim(spec: TinySpec) -> int:
    if spec.hidden_size % spec.heads:
        raise ModelError(f"tiny spec: hidden_size {spec.hidden_size} is not divisible by "
                         f"heads {spec.heads}")
    if spec.heads % spec.kv_heads:
        raise ModelError(f"tiny spec: heads {spec.heads} is not divisible by kv_heads {spec.kv_heads}")
    return spec.hidden_size // spec.heads


def _text_common(spec: TinySpec, tok, max_positions: int) -> dict[str, Any]:
    return dict(vocab_size=len(tok), hidden_size=spec.hidden_size,
                intermediate_size=_intermediate(spec), num_hidden_layers=spec.layers,
                num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                max_position_embeddings=max_positions, bos_token_id=None,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                initializer_range=spec.init_std or INIT_STD)


def _build_text(spec: TinySpec, out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    head_dim = _head_dim(spec)
    tok = _tokenizer_for(spec, out.parent)
    common = _text_common(spec, tok, 4096)
    torch.manual_seed(spec.seed)
    if spec.arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=head_dim, tie_word_embeddings=True, **common))
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def mrope_section(head_dim: int) -> list[int]:
    """Split head_dim/2 rotary pairs over (time, height, width) like Qwen2.5-VL's [16, 24, 24]."""
    half = head_dim // 2
    t = max(1, half // 4)
    h = (half - t) // 2
    return [t, h, half - t - h]


# Small frames stay small: the default processor would upscale 56x56 frames to 336x336.
TINY_VL_SIZE = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}


def _build_vl(spec: TinySpec, out: Path) -> None:
    import torch
    from transformers import (GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor)

    tok = _tokenizer_for(spec, out.parent)
    head_dim = _head_dim(spec)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text_cfg = _text_common(spec, tok, 8192)
    text_cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6,
                                   "mrope_section": mrope_section(head_dim)}
    vis_width = max(16, spec.hidden_size // 2)
    vis_cfg = dict(depth=2, hidden_size=vis_width, intermediate_size=2 * vis_width, num_heads=2,
                   patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                   out_hidden_size=spec.hidden_size, window_size=112, fullatt_block_indexes=[1],
                   tokens_per_second=2)
    cfg = Qwen2_5_VLConfig(text_config=text_cfg, vision_config=vis_cfg, tie_word_embeddings=True,
                           initializer_range=spec.init_std or INIT_STD,
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(spec.seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    proc = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=dict(TINY_VL_SIZE)), tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(size=dict(TINY_VL_SIZE), cap_pixels_per_frame=True),
        chat_template=CHAT_TEMPLATE)
    model.save_pretrained(out)
    proc.save_pretrained(out)
    tok.save_pretrained(out)


def _clip_config(spec: TinySpec) -> dict[str, Any]:
    width = spec.hidden_size
    patch = 16 if spec.image_size % 16 == 0 else 8
    if spec.image_size % patch:
        raise ModelError(f"tiny spec: open_clip image_size {spec.image_size} must be a multiple of 8")
    return {"embed_dim": width,
            "vision_cfg": {"image_size": spec.image_size, "layers": spec.layers, "width": width,
                           "patch_size": patch, "head_width": max(8, width // spec.heads)},
            "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": width,
                         "heads": spec.heads, "layers": spec.layers}}


CLIP_CHECKPOINT = "open_clip_model.pt"


def _build_clip(spec: TinySpec, out: Path) -> None:
    import open_clip
    import torch

    name = clip_config_name(spec)
    cfg_file = out / f"{name}.json"
    cfg_file.write_text(json.dumps(_clip_config(spec), indent=2))
    open_clip.add_model_config(cfg_file)
    torch.manual_seed(spec.seed)
    model = open_clip.create_model(name, pretrained=None)
    torch.save(model.state_dict(), out / CLIP_CHECKPOINT)
