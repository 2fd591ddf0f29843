"""Single-process GRPO reference loop on the toy digit-arithmetic task.

A tiny randomly initialised Qwen2 (built from a config, nothing downloaded)
learns single-digit addition ("3+5=" -> "8<eos>") from a rule-based reward.

This is the golden reference for the distributed pipeline: same tokenizer,
task, reward, sampler and loss; the defaults are the tuned hyperparameters
(see docs/grpo_digits.md).  One JSON line per step on stdout:

    {"step": 0, "reward_mean": ..., "accuracy": ..., "seconds": ..., ...}

``accuracy`` is the headline metric: the fraction of this step's sampled
completions (temperature 1) that are exactly correct.  ``reward_mean`` is the
mean *training* reward, which adds ``--format-bonus`` (default 0.1) for a
well-formed wrong answer.  Extra fields: ``cpu_seconds``, ``loss``,
``clipfrac``, ``kl`` (k3 estimate vs the initial policy on the sampled
tokens), ``resp_len`` (tokens incl. eos), ``lr`` (used this step) and, every
``--eval-every`` steps, ``greedy_acc`` on a fixed set of 256 problems.

Run (one CPU core):

    OMP_NUM_THREADS=1 .venv/bin/python examples/grpo_single_process.py --seed 0
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import math
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from engines.tokenizer import CharTokenizer  # noqa: E402
from pipelines.tasks import digit_accuracy, digit_reward, make_digit_task  # noqa: E402


# --------------------------------------------------------------------------- model
def build_model(tok: CharTokenizer, hidden: int, layers: int, heads: int, seed: int, intermediate: int = 0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=tok.vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg)
    return model


# ------------------------------------------------------------------------ sampling
def _cache_kw(model) -> str:
    """transformers >= 5.x calls the KV cache argument ``cache``; older ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out):
    return out.cache if getattr(out, "cache", None) is not None else out.past_key_values


@torch.no_grad()
def sample(model, tok, prompt_ids, prompt_mask, max_new_tokens, temperature, generator):
    """Ancestral sampling with a KV cache, prompts left-padded (``temperature <= 0``: greedy).

    Returns ``(response_ids [B,L], response_mask [B,L])``; the mask covers the
    generated tokens up to and including ``<eos>``; later positions are pad.
    """
    B = prompt_ids.shape[0]
    attn = prompt_mask.clone()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    ckw = _cache_kw(model)
    out = model(input_ids=prompt_ids, attention_mask=attn, position_ids=pos, use_cache=True)
    past, logits = _cache_of(out), out.logits[:, -1, :]
    last_pos = pos[:, -1:]
    finished = torch.zeros(B, dtype=torch.bool)
    toks, masks = [], []
    for t in range(max_new_tokens):
        if temperature <= 0:  # greedy
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        nxt = torch.where(finished, torch.full_like(nxt, tok.pad_token_id), nxt)
        toks.append(nxt)
        masks.append((~finished).long())
        finished = finished | (nxt == tok.eos_token_id)
        if bool(finished.all()) or t == max_new_tokens - 1:
            break
        attn = torch.cat([attn, torch.ones(B, 1, dtype=attn.dtype)], dim=1)
        last_pos = last_pos + 1
        out = model(
            input_ids=nxt[:, None], attention_mask=attn, position_ids=last_pos,
            use_cache=True, **{ckw: past},
        )
        past, logits = _cache_of(out), out.logits[:, -1, :]
    return torch.stack(toks, 1), torch.stack(masks, 1)


def decode_responses(tok, response_ids):
    """Each response up to its first <eos>; a pad or bos the policy sampled before it stays in the text (as the
    pipeline's rule reward keeps it), so ``1<pad>5`` is not read as ``15``."""
    return [tok.decode(tok.truncate_at_eos(r), skip_special_tokens=False) for r in response_ids.tolist()]


# -------------------------------------------------------------------------- loss
def response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, with_entropy=False):
    """Per-token log-probs of the response tokens under ``model``; shape [B, L]
    (and the per-token entropy of the policy if ``with_entropy``)."""
    ids = torch.cat([prompt_ids, response_ids], 1)
    attn = torch.cat([prompt_mask, torch.ones_like(response_mask)], 1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits
    P, L = prompt_ids.shape[1], response_ids.shape[1]
    logp_all = F.log_softmax(logits[:, P - 1 : P - 1 + L, :].float(), -1)
    logp = torch.gather(logp_all, -1, response_ids[..., None]).squeeze(-1)
    if with_entropy:
        return logp, -(logp_all.exp() * logp_all).sum(-1)
    return logp


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4, scale: bool = True):
    """GRPO advantages: reward minus group mean (optionally / group std)."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if scale:
        adv = adv / (r.std(1, keepdim=True) + eps)
    return adv.view(-1)


def grpo_loss(logp, old_logp, adv, mask, clip_eps, ref_logp=None, kl_coef=0.0, kl_type="k3",
              entropy=None, ent_coef=0.0):
    """PPO-clip surrogate (+ optional KL penalty to a reference, - entropy bonus),
    token-mean over all response tokens in the batch.

    ``kl_type``: ``"k3"`` = exp(ref-logp) - (ref-logp) - 1 (GRPO paper / verl
    ``low_var_kl``; its gradient is that of the mass-covering KL(ref||pi));
    ``"k2"`` = 0.5 * (logp - ref)^2 (verl ``mse``; gradient of the
    mode-seeking KL(pi||ref))."""
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    per_tok = -torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    if kl_coef and ref_logp is not None:
        d = ref_logp - logp
        if kl_type == "k3":
            per_tok = per_tok + kl_coef * (torch.exp(d) - d - 1)
        elif kl_type == "k2":
            per_tok = per_tok + kl_coef * 0.5 * d * d
        else:
            raise ValueError(f"unknown kl_type {kl_type!r}")
    if ent_coef and entropy is not None:
        per_tok = per_tok - ent_coef * entropy
    m = mask.float()
    loss = (per_tok * m).sum() / m.sum().clamp(min=1)
    clipfrac = (((ratio - 1).abs() > clip_eps).float() * m).sum() / m.sum().clamp(min=1)
    return loss, clipfrac


# --------------------------------------------------------------------- warm start
def format_warm_start(model, tok, opt, steps, batch, seed, task_kw, answer_pool):
    """Supervised steps on the answer FORMAT only: each prompt is followed by a
    uniformly *random* (almost always wrong) answer from ``answer_pool`` + <eos>.
    Teaches "emit a number, then stop" without teaching arithmetic."""
    rng = random.Random(seed + 7919)
    for s in range(steps):
        recs = make_digit_task(batch, seed=10_000_019 + seed * 1000 + s, **task_kw)
        texts = [r["prompt"] + rng.choice(answer_pool) for r in recs]
        ids, mask = tok.batch_encode(texts, padding_side="right", add_bos=True, add_eos=True)
        plen = [len(r["prompt"]) + 1 for r in recs]
        labels = ids.clone()
        labels[mask == 0] = -100
        for i, p in enumerate(plen):
            labels[i, :p] = -100  # loss on the answer + eos only
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


# -------------------------------------------------------------------------- main
def lr_factor(step: int, args) -> float:
    """Linear warmup over ``warmup_steps``, then constant or cosine decay."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant":
        return 1.0
    horizon = max(1, (args.decay_steps or args.steps) - args.warmup_steps)
    frac = min(1.0, (step - args.warmup_steps) / horizon)
    return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--time-limit", type=float, default=0.0, help="stop after this many seconds (0 = off)")
    p.add_argument("--target-accuracy", type=float, default=0.0,
                   help="stop once the mean accuracy of the last 5 steps exceeds this (0 = off)")
    # task
    p.add_argument("--max-operand", type=int, default=9)
    p.add_argument("--ops", default="+")
    p.add_argument("--modulo", type=int, default=0)
    # model
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=0, help="MLP width (0 = 4 * hidden)")
    # rl
    p.add_argument("--prompts-per-step", type=int, default=128)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine",
                   help="after warmup: constant, or cosine decay to lr*min-lr-ratio at --decay-steps")
    p.add_argument("--decay-steps", type=int, default=0, help="cosine horizon (0 = --steps)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=3)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--ppo-epochs", type=int, default=4, help="optimizer passes over each rollout batch")
    p.add_argument("--minibatches", type=int, default=4, help="minibatches per pass")
    p.add_argument("--no-std-norm", action="store_true", help="advantage = r - mean (Dr.GRPO style)")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--kl-coef", type=float, default=0.05, help="k3 KL penalty to the initial policy (0 = no ref model)")
    p.add_argument("--kl-type", choices=("k3", "k2"), default="k3")
    p.add_argument("--ent-coef", type=float, default=0.0, help="entropy bonus")
    p.add_argument("--format-bonus", type=float, default=0.1, help="reward for a well-formed wrong answer")
    p.add_argument("--warm-start-steps", type=int, default=0, help="format-only SFT steps (random answers)")
    p.add_argument("--warm-start-lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=10,
                   help="every N steps (and at the end) add greedy accuracy on a fixed eval set as 'greedy_acc'")
    p.add_argument("--show-every", type=int, default=0, help="print a few sample completions to stderr every N steps")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    random.seed(args.seed)
    tok = CharTokenizer()
    task_kw = dict(max_operand=args.max_operand, ops=tuple(args.ops), modulo=args.modulo or None)

    t0, c0 = time.perf_counter(), time.process_time()
    model = build_model(tok, args.hidden, args.layers, args.heads, args.seed, args.intermediate)
    model.train()

    if args.warm_start_steps:
        pool = sorted({r["answer"] for r in make_digit_task(2000, seed=123, **task_kw)}, key=int)
        ws_opt = torch.optim.AdamW(model.parameters(), lr=args.warm_start_lr, weight_decay=0.0)
        format_warm_start(model, tok, ws_opt, args.warm_start_steps, 64, args.seed, task_kw, pool)

    ref_model = None
    if args.kl_coef:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args))
    gen = torch.Generator().manual_seed(args.seed)
    G = args.group_size
    recent: list[float] = []

    eval_recs = make_digit_task(256, seed=987_654_321, **task_kw)

    def greedy_eval(show_errors=False):
        e_ids, e_mask = tok.batch_encode([r["prompt"] for r in eval_recs], padding_side="left", add_bos=True)
        e_out, _ = sample(model, tok, e_ids, e_mask, args.max_new_tokens, 0.0, None)
        e_texts = decode_responses(tok, e_out)
        if show_errors:
            errs = sorted({f"{r['prompt']}{t!r}" for r, t in zip(eval_recs, e_texts) if t != r["answer"]})
            print(f"[eval errors] {len(errs)}: {' '.join(errs)}", file=sys.stderr, flush=True)
        return digit_accuracy(e_texts, [r["answer"] for r in eval_recs])

    for step in range(args.steps):
        recs = make_digit_task(args.prompts_per_step, seed=args.seed * 1_000_003 + step, **task_kw)
        prompts = [r["prompt"] for r in recs for _ in range(G)]
        answers = [r["answer"] for r in recs for _ in range(G)]
        p_ids, p_mask = tok.batch_encode(prompts, padding_side="left", add_bos=True)

        r_ids, r_mask = sample(model, tok, p_ids, p_mask, args.max_new_tokens, args.temperature, gen)
        texts = decode_responses(tok, r_ids)
        rewards = torch.tensor(digit_reward(texts, answers, format_bonus=args.format_bonus))
        acc = digit_accuracy(texts, answers)
        adv = group_advantages(rewards, G, scale=not args.no_std_norm)

        with torch.no_grad():
            old_logp = response_logprobs(model, p_ids, p_mask, r_ids, r_mask)
            ref_logp = response_logprobs(ref_model, p_ids, p_mask, r_ids, r_mask) if ref_model else None

        m = r_mask.float()
        kl = 0.0
        if ref_logp is not None:
            d = ref_logp - old_logp
            kl = ((torch.exp(d) - d - 1) * m).sum().item() / max(1.0, m.sum().item())
        lr_now = sched.get_last_lr()[0]

        B = p_ids.shape[0]
        mb = max(1, B // args.minibatches)
        losses, clipfracs = [], []
        for _ in range(args.ppo_epochs):
            perm = torch.randperm(B, generator=gen)
            for i in range(0, B, mb):
                idx = perm[i : i + mb]
                if adv[idx].abs().sum() == 0 and not (args.kl_coef or args.ent_coef):
                    continue  # no learning signal in this minibatch
                logp, ent = response_logprobs(model, p_ids[idx], p_mask[idx], r_ids[idx], r_mask[idx], True)
                loss, cf = grpo_loss(
                    logp, old_logp[idx], adv[idx], r_mask[idx], args.clip,
                    ref_logp=None if ref_logp is None else ref_logp[idx], kl_coef=args.kl_coef, kl_type=args.kl_type,
                    entropy=ent, ent_coef=args.ent_coef,
                )
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if args.grad_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
                opt.step()
                losses.append(loss.item())
                clipfracs.append(cf.item())
        sched.step()

        recent = (recent + [acc])[-5:]
        rec = {
            "step": step,
            "reward_mean": round(rewards.mean().item(), 4),
            "accuracy": round(acc, 4),
            "seconds": round(time.perf_counter() - t0, 2),
            "cpu_seconds": round(time.process_time() - c0, 2),
            "loss": round(sum(losses) / len(losses), 5) if losses else 0.0,
            "clipfrac": round(sum(clipfracs) / len(clipfracs), 4) if clipfracs else 0.0,
            "kl": round(kl, 5),
            "resp_len": round(r_mask.sum(1).float().mean().item(), 3),
            "lr": round(lr_now, 7),
        }
        last = step == args.steps - 1 or (args.time_limit and time.perf_counter() - t0 > args.time_limit) or (
            args.target_accuracy and len(recent) == 5 and sum(recent) / 5 > args.target_accuracy)
        if args.eval_every and (step % args.eval_every == 0 or last):
            rec["greedy_acc"] = round(greedy_eval(show_errors=bool(last and args.show_every)), 4)
        print(json.dumps(rec), flush=True)
        if args.show_every and step % args.show_every == 0:
            shown = ", ".join(f"{prompts[i]}{texts[i]!r}" for i in range(0, len(prompts), max(1, len(prompts) // 8)))
            print(f"[step {step}] {shown}", file=sys.stderr, flush=True)
        if args.target_accuracy and len(recent) == 5 and sum(recent) / 5 > args.target_accuracy:
            break
        if args.time_limit and time.perf_counter() - t0 > args.time_limit:
            break


if __name__ == "__main__":
    main()
