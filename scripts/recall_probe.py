"""Toy recall (issue #64): can a tiny Qwen3 learn `k1 v1 ... k8 v8 ? k = v ;` (8 queries a sequence)?

The arms the mini base's loss was chosen on (docs/experiments/mini_base.md): `--loss answers` (the value after each
`=` only, as SFT's completion-only loss and the earlier probes trained) against `--loss all` (next-token loss on every
token), `--repeat` (a share of sequences made of a random run of tokens written again and again), and seeds; the
second session's remedies: `--pairs-min` (a curriculum over the number of pairs), `--lr`, `--arch qwen2` (no
RMSNorm on queries and keys) and `--key-words 2` (keys of two recurring words, as the drills' object names). Prints
held-out accuracy on the first query every 100 steps and stops at 99%.

    python scripts/recall_probe.py --loss all --seed 0 --out runs/recall_all_s0.jsonl
"""
import argparse, json, random, time
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
ap = argparse.ArgumentParser()
ap.add_argument("--loss", default="answers", choices=["answers", "all"])
ap.add_argument("--init", type=float, default=0.02)
ap.add_argument("--lr", type=float, default=1e-3)
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--steps", type=int, default=2000)
ap.add_argument("--pairs", type=int, default=8)
ap.add_argument("--nq", type=int, default=8)
ap.add_argument("--nkeys", type=int, default=12)
ap.add_argument("--nvals", type=int, default=4)
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--hidden", type=int, default=128)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--repeat", type=float, default=0.0, help="share of sequences that are random tokens written twice")
ap.add_argument("--pairs-min", type=int, default=0, help="curriculum: start with this many pairs (0: no curriculum)")
ap.add_argument("--grow", type=int, default=150, help="curriculum: steps between adding one pair")
ap.add_argument("--key-words", type=int, default=1, choices=[1, 2],
                help="2: a key is two tokens (colour, shape) from a 4 x 4 grid, so each word recurs across keys")
ap.add_argument("--arch", default="qwen3", choices=["qwen3", "qwen2"],
                help="qwen2: no RMSNorm on queries and keys, so attention logits are not bounded by sqrt(head_dim)")
ap.add_argument("--out", required=True)
a = ap.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(a.seed)
VALS = [f"v{i}" for i in range(a.nvals)]
if a.key_words == 2:
    WORDS = [f"c{i}" for i in range(4)] + [f"s{i}" for i in range(4)]
    KEYS = [(f"c{i}", f"s{j}") for i in range(4) for j in range(4)]
else:
    WORDS = [f"k{i}" for i in range(a.nkeys)]
    KEYS = [(w,) for w in WORDS]
vocab = ["<pad>", "?", "=", ";"] + WORDS + VALS
ix = {w: i for i, w in enumerate(vocab)}
Config, Model = (Qwen3Config, Qwen3ForCausalLM) if a.arch == "qwen3" else (Qwen2Config, Qwen2ForCausalLM)
cfg = Config(vocab_size=len(vocab), hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=a.layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=a.hidden // 4, max_position_embeddings=512,
                  initializer_range=a.init, tie_word_embeddings=True, pad_token_id=0, bos_token_id=None, eos_token_id=None)
model = Model(cfg)
def example(rng, pairs=None):
    pairs = pairs or a.pairs
    keys = rng.sample(KEYS, pairs); vals = [rng.choice(VALS) for _ in keys]
    words = []
    for k, v in zip(keys, vals): words += [*k, v]
    ans = []
    for _ in range(a.nq):
        q = rng.randrange(pairs)
        words += ["?", *keys[q], "="]; ans.append(len(words)); words += [vals[q], ";"]
    return [ix[w] for w in words], ans
def repeated(rng):
    ex, ans = example(rng)
    n = len(ex) // 2
    seq = [rng.randrange(4, len(vocab)) for _ in range(n // 2)]
    words = (seq * 8)[:len(ex)]
    return words, ans
def batch(rng, n, rep=0.0, pairs=None):
    exs = [repeated(rng) if rng.random() < rep else example(rng, pairs) for _ in range(n)]
    ids = torch.tensor([e[0] for e in exs])
    return ids, [e[1] for e in exs]
opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
test = batch(random.Random(10 ** 6), 256)
def evaluate():
    model.eval()
    with torch.no_grad():
        ids, ans = test
        pred = model(input_ids=ids).logits.argmax(-1)
        hit = [int(pred[b, p - 1] == ids[b, p]) for b in range(len(ans)) for p in ans[b][:1]]
    model.train(); return sum(hit) / len(hit)
rng = random.Random(a.seed); log = open(a.out, "w"); t0 = time.time()
for step in range(a.steps + 1):
    if step % 100 == 0:
        row = {"step": step, "s": round(time.time() - t0, 1), "acc_first_query": evaluate()}
        print(json.dumps(row), flush=True); log.write(json.dumps(row) + "\n"); log.flush()
        if row["acc_first_query"] >= 0.99: break
    pairs = min(a.pairs, a.pairs_min + step // a.grow) if a.pairs_min else a.pairs
    ids, ans = batch(rng, a.batch, a.repeat, pairs)
    logits = model(input_ids=ids).logits[:, :-1]
    tgt = ids[:, 1:].clone()
    if a.loss == "answers":
        mask = torch.zeros_like(tgt, dtype=torch.bool)
        for b, ps in enumerate(ans):
            for p in ps: mask[b, p - 1] = True
        tgt[~mask] = -100
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)
    loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step(); sched.step(); opt.zero_grad()
