"""A taught tiny llama and a trained one-layer EAGLE3 head for it, cached (a random tiny target's
next token is chaos to a one-layer head): `python -m ...testing.eagle3_heads CACHE_DIR`.

(a) The tiny llama (testing/checkpoints.py's config and tokenizer) learns a grammar: phrases over
    a scattered alphabet joined by a seeded Markov chain (Grammar); its greedy path is learnable.
(b) A head learns the taught target's greedy tokens with EAGLE3's training-time test: STEPS steps,
    teacher-forced tokens, the head's own pre-norm hidden carried from step to step.
(c) Saved as vLLM loads yuhuili's heads: LlamaForCausalLMEagle3, `midlayer.*`, an lm_head over the
    most frequent greedy tokens (d2t offsets), no embed_tokens (the target's is shared).
Aux ids: with 2 layers the default (2, L // 2, L - 3) = (2, 1, -1) is invalid; the head config
names (0, 1, 2) = the embeddings, layer 0's output, layer 1's output before the final norm (vLLM
0.32: id k = the residual stream entering layer k, id L = the one entering the final norm).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .checkpoints import build_checkpoint, checkpoint_key, family_config

FAMILY = "llama"
# vLLM's CPU attention takes head_dim in multiples of 32 only (csrc: "expect head_dim to be multiples
# of 32"): with the tiny llama's 4 x 16 the reference engine would not run, so its heads are 32 wide.
OVERRIDES = dict(head_dim=32)
SEED = 0
STEPS = 3  # training-time-test steps = the K the acceptance figures use
ALPHABET, PHRASES, DRAFT_VOCAB = 96, 32, 48  # the grammar uses 78 tokens: rare ones cannot be drafted
SEQ, BATCH, TARGET_STEPS, HEAD_STEPS = 64, 32, 300, 400


def cache_key() -> str:
    blob = Path(__file__).read_bytes() + checkpoint_key(FAMILY).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def trained_pair(cache_dir: Path) -> tuple[Path, Path]:
    """(taught target checkpoint folder, EAGLE3 head folder), built once under `cache_dir`."""
    out = Path(cache_dir) / f"eagle3-{FAMILY}-{cache_key()}"
    if not (out / "manifest.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.with_name(f".{out.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / "manifest.json").is_file():
                staging = out.with_name(out.name + ".partial")
                shutil.rmtree(staging, ignore_errors=True)
                build(staging)
                staging.rename(out)
    return out / "target", out / "head"


class Grammar:
    """Phrases over a scattered alphabet of token ids, joined by a Markov chain over (phrase, the
    previous phrase's parity): the next phrase depends on more than the last token."""

    def __init__(self, vocab_known: int, gen: torch.Generator):
        self.alphabet = 4 + torch.randperm(vocab_known - 4, generator=gen)[:ALPHABET]  # no specials
        a, lengths = self.alphabet, torch.randint(3, 8, (PHRASES,), generator=gen).tolist()
        self.phrases = [a[torch.randint(0, ALPHABET, (n,), generator=gen)].tolist() for n in lengths]
        self.successors = torch.rand(2 * PHRASES, PHRASES, generator=gen).argsort(-1)[:, :3]  # 3 each
        self.odds = torch.tensor([0.6, 0.25, 0.15])

    def sample(self, n: int, gen: torch.Generator) -> list[int]:
        before, phrase = torch.randint(0, PHRASES, (2,), generator=gen).tolist()
        out = self.phrases[phrase][int(torch.randint(0, 3, (1,), generator=gen)) :]  # may start mid-phrase
        while len(out) < n:
            pick = torch.multinomial(self.odds, 1, generator=gen)
            before, phrase = phrase, int(self.successors[2 * phrase + before % 2][pick])
            out += self.phrases[phrase]
        return out[:n]

    def batch(self, b: int, n: int, gen: torch.Generator) -> torch.Tensor:
        return torch.tensor([self.sample(n, gen) for _ in range(b)])


def fit(params: list, steps: int, losses_of, name: str) -> None:
    """AdamW (warm-up, then linear decay; clipped) on the mean of `losses_of(step)`."""
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 30) * (1 - i / steps))
    for step in range(steps):
        losses = losses_of(step)
        opt.zero_grad()
        (sum(losses) / len(losses)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  {name} step {step:4d} loss " + " ".join(f"{x.item():.3f}" for x in losses), flush=True)


@torch.no_grad()
def target_states(model, ids: torch.Tensor, aux_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(cat of the aux states [B, T, n * H], greedy next tokens [B, T]): id k = the residual stream
    entering layer k (k = L: entering the final norm), as vLLM captures them."""
    inner, seen = model.model, []
    hook = lambda mod, args, kwargs: seen.append(args[0] if args else kwargs["hidden_states"])  # noqa: E731
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in [*inner.layers, inner.norm]]
    logits = model(input_ids=ids).logits  # no try: a failure ends the build, hooks and all
    for h in handles:
        h.remove()
    return torch.cat([seen[k] for k in aux_ids], -1), logits.argmax(-1)


@torch.no_grad()
def greedy(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """`ids` and the target's greedy continuation of n tokens (with its KV cache)."""
    step, past = ids, None
    for _ in range(n):
        out = model(input_ids=step, past_key_values=past, use_cache=True, logits_to_keep=1)
        step, past = out.logits[:, -1:].argmax(-1), out.past_key_values
        ids = torch.cat([ids, step], 1)
    return ids


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:  # x [B, N, heads, D]
    d = x.shape[-1]
    freqs = pos[:, None].float() / theta ** (torch.arange(0, d, 2).float() / d)
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def head_steps(p: dict, cfg: dict, embed, g, tokens, steps: int, teacher: torch.Tensor | None = None):
    """Draft-vocab logits [B, N, Vd] of each step. Slot t: aux states at t, token x[t+1], position t,
    predicts x[t+2]; step s > 0 reads its own pre-norm hidden, token teacher[s][:, t] or its own
    draft, at position t + s, attending to step 0's keys <= t and its slot's keys of steps 1..s."""
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    b, n, _ = g.shape
    h, keys, values, out = g @ p["fc.weight"].T, [], [], []
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for s in range(steps):
        pos = torch.arange(n) + s
        x = torch.cat([rms(embed(tokens), p["midlayer.input_layernorm.weight"], eps),
                       rms(h, p["midlayer.hidden_norm.weight"], eps)], -1)  # fmt: skip
        q = rope((x @ p["midlayer.self_attn.q_proj.weight"].T).view(b, n, nh, d), pos, theta)
        k = rope((x @ p["midlayer.self_attn.k_proj.weight"].T).view(b, n, nkv, d), pos, theta)
        v = (x @ p["midlayer.self_attn.v_proj.weight"].T).view(b, n, nkv, d)
        keys.append(k.repeat_interleave(nh // nkv, 2))
        values.append(v.repeat_interleave(nh // nkv, 2))
        first = torch.einsum("bthd,bphd->bhtp", q, keys[0]).masked_fill(~causal, float("-inf"))
        own = [torch.einsum("bthd,bthd->bht", q, kj)[..., None] for kj in keys[1:]]
        att = torch.softmax(torch.cat([first, *own], -1) * d**-0.5, -1)
        o = torch.einsum("bhtp,bphd->bthd", att[..., :n], values[0])
        for j, vj in enumerate(values[1:]):
            o = o + att[..., n + j].transpose(1, 2)[..., None] * vj
        residual = h + o.reshape(b, n, nh * d) @ p["midlayer.self_attn.o_proj.weight"].T
        y = rms(residual, p["midlayer.post_attention_layernorm.weight"], eps)
        mlp = F.silu(y @ p["midlayer.mlp.gate_proj.weight"].T) * (y @ p["midlayer.mlp.up_proj.weight"].T)
        h = residual + mlp @ p["midlayer.mlp.down_proj.weight"].T  # pre-norm: the next step's hidden
        out.append(rms(h, p["norm.weight"], eps) @ p["lm_head.weight"].T)
        draft = out[-1].argmax(-1)
        tokens = teacher[s + 1] if teacher is not None and s + 1 < steps else draft + p["d2t"][draft]
    return out


def train_head(p: dict, cfg: dict, embed, g, ids, labels, t2d, gen) -> None:
    """Teacher-forced training-time test: step s of slot t reads x[t+s+1] and learns the target's
    greedy token after it (labels[:, t+s+1], in draft ids; -100 where outside the draft vocab)."""
    params = [v.requires_grad_(True) for k, v in p.items() if k != "d2t"]
    n, draft_labels = SEQ - 1, torch.where(t2d[labels] >= 0, t2d[labels], -100)

    def losses_of(step: int) -> list[torch.Tensor]:
        rows = torch.randint(0, ids.shape[0], (BATCH,), generator=gen)
        x, y = F.pad(ids[rows], (0, STEPS)), F.pad(draft_labels[rows], (0, STEPS), value=-100)
        teacher, wanted = ([z[:, 1 + s : n + 1 + s] for s in range(STEPS)] for z in (x, y))
        logits = head_steps(p, cfg, embed, g[rows, :n], teacher[0], STEPS, teacher)
        return [F.cross_entropy(lg.flatten(0, 1), w.flatten()) for lg, w in zip(logits, wanted, strict=True)]

    fit(params, HEAD_STEPS, losses_of, "head")
    p.update({k: v.detach() for k, v in p.items()})


@torch.no_grad()
def acceptance(target, p: dict, cfg: dict, prompts: torch.Tensor, new: int, k: int = STEPS) -> dict:
    """Greedy speculative decoding as vLLM runs it, recomputed from scratch each step: vLLM's
    counters, mean acceptance length (1 + accepted / drafts), whether the tokens equal greedy."""
    aux = tuple(cfg["eagle_aux_hidden_state_layer_ids"])
    embed, drafts, accepted, per_pos, same = target.model.embed_tokens, 0, 0, [0] * k, True
    for prompt in prompts:
        seq = prompt[None]
        g, y = target_states(target, seq, aux)
        nxt, out = y[:, -1:], []
        while len(out) + 1 < new:  # vLLM's count: nxt is emitted; the request ends at `new` tokens
            out.append(int(nxt))
            tokens = torch.cat([seq[:, 1:], nxt], 1)
            guess = torch.stack([lg[0, -1].argmax() for lg in head_steps(p, cfg, embed, g, tokens, k)])
            guess = (guess + p["d2t"][guess])[None]
            seq = torch.cat([seq, nxt, guess], 1)
            g, y = target_states(target, seq, aux)
            verdict = y[0, -k - 1 :]  # the target's token after nxt and after each draft
            a = int((guess[0] == verdict[:k]).long().cumprod(0).sum())
            drafts, accepted = drafts + 1, accepted + a
            per_pos[:a] = [c + 1 for c in per_pos[:a]]
            out += guess[0, :a].tolist()
            keep = seq.shape[1] - k + a
            seq, g, nxt = seq[:, :keep], g[:, :keep], verdict[a : a + 1][None]
        same &= greedy(target, prompt[None], new)[0, len(prompt) :].tolist() == (out + [int(nxt)])[:new]
    return dict(k=k, drafts=drafts, accepted=accepted, per_pos=per_pos,
                mean_acceptance_length=1 + accepted / drafts, equals_greedy=bool(same))  # fmt: skip


def head_config(tc) -> dict:
    aux = [0, tc.num_hidden_layers // 2, tc.num_hidden_layers]  # see the module docstring
    # transformers 5 keeps the base in rope_parameters, 4.57 (the SDK environment) in rope_theta
    theta = (getattr(tc, "rope_parameters", None) or {}).get("rope_theta") or tc.rope_theta
    return dict(
        architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=tc.hidden_size,
        num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim, intermediate_size=tc.intermediate_size, hidden_act="silu",
        rms_norm_eps=tc.rms_norm_eps, vocab_size=tc.vocab_size, draft_vocab_size=DRAFT_VOCAB,
        max_position_embeddings=tc.max_position_embeddings, rope_theta=theta,
        num_hidden_layers=1, eagle_aux_hidden_state_layer_ids=aux, tie_word_embeddings=False,
        bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, dtype="float32",
    )  # fmt: skip


def new_head(cfg: dict, target, selected: torch.Tensor, gen: torch.Generator) -> dict:
    h, nh, nkv, d, i = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"))  # fmt: skip
    shapes = {"fc.weight": (h, 3 * h), "midlayer.self_attn.q_proj.weight": (nh * d, 2 * h),
              "midlayer.self_attn.k_proj.weight": (nkv * d, 2 * h), "midlayer.self_attn.v_proj.weight": (nkv * d, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, nh * d), "midlayer.mlp.gate_proj.weight": (i, h),
              "midlayer.mlp.up_proj.weight": (i, h), "midlayer.mlp.down_proj.weight": (h, i)}  # fmt: skip
    p = {k: torch.randn(s, generator=gen) * s[1] ** -0.5 for k, s in shapes.items()}
    for k in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        p[f"midlayer.{k}.weight"] = torch.ones(h)
    p["norm.weight"] = torch.ones(h)
    p["lm_head.weight"] = target.lm_head.weight.detach()[selected].clone()  # a warm start
    p["d2t"] = selected - torch.arange(len(selected))
    return p


def build(folder: Path) -> None:
    """folder/target, folder/head and folder/manifest.json (acceptance figures, file digests)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    threads, started = torch.get_num_threads(), time.perf_counter()
    torch.set_num_threads(1)  # one reduction order on every host; no spinning threads on a busy one
    target_dir, head_dir = folder / "target", folder / "head"
    try:
        gen = torch.Generator().manual_seed(SEED)
        torch.manual_seed(SEED)
        base = build_checkpoint(FAMILY, folder / "base", config=family_config(FAMILY) | OVERRIDES)
        target = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        grammar = Grammar(400, gen)  # the tiny tokenizer's vocabulary (checkpoints.build_tokenizer)
        print(f"eagle3 fixture: teaching the tiny {FAMILY} a grammar ({TARGET_STEPS} steps)", flush=True)
        batch = lambda _: [target(input_ids=(x := grammar.batch(BATCH, SEQ, gen)), labels=x).loss]  # noqa: E731
        fit(list(target.train().parameters()), TARGET_STEPS, batch, "target")
        target.eval()
        target.save_pretrained(target_dir)
        for f in base.iterdir():
            if not (target_dir / f.name).exists():
                shutil.copy(f, target_dir / f.name)  # the tokenizer files
        cfg = head_config(target.config)
        print(f"eagle3 fixture: target data ({time.perf_counter() - started:.0f}s)", flush=True)
        prompts = grammar.batch(256, 16, gen)
        ids = torch.cat([greedy(target, prompts[:192], SEQ - 16), grammar.batch(64, SEQ, gen)])
        g, labels = target_states(target, ids, tuple(cfg["eagle_aux_hidden_state_layer_ids"]))
        counts = torch.bincount(labels.flatten(), minlength=cfg["vocab_size"])  # EAGLE3's draft vocabulary:
        selected = counts.argsort(descending=True, stable=True)[:DRAFT_VOCAB].sort().values  # most frequent
        t2d = torch.full((cfg["vocab_size"],), -1, dtype=torch.long)
        t2d[selected] = torch.arange(DRAFT_VOCAB)
        p = new_head(cfg, target, selected, gen)
        print(f"eagle3 fixture: training the head ({HEAD_STEPS} steps)", flush=True)
        train_head(p, cfg, target.model.embed_tokens, g, ids, labels, t2d, gen)
        head_dir.mkdir(parents=True)
        (head_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(
            {**{k: v.contiguous() for k, v in p.items()}, "t2d": t2d >= 0}, head_dir / "model.safetensors"
        )
        figures = acceptance(target, p, cfg, prompts[192:200], 32)
        print(f"eagle3 fixture: acceptance {figures} ({time.perf_counter() - started:.0f}s)", flush=True)
        shutil.rmtree(base)
        manifest = dict(acceptance=figures, files=digests(folder), prompts=prompts[192:200].tolist())
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    finally:
        torch.set_num_threads(threads)


def digests(folder: Path) -> dict[str, str]:
    """SHA-256 of each file under `folder` but the manifest."""
    files = sorted(f for f in folder.rglob("*") if f.is_file() and f.name != "manifest.json")
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


if __name__ == "__main__":
    print(trained_pair(Path(sys.argv[1])))
