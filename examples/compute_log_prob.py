"""Sample from your own checkpoint with a 2-rank actor group, then score the samples with ``compute_log_prob``.

    python examples/compute_log_prob.py                # a tiny random Qwen2, saved to a temp dir first
    python examples/compute_log_prob.py --model DIR    # your own local Hugging Face checkpoint directory

The first use of orchestra, as a plain async script: start a group on a model directory (``model_path=``, loaded
offline), ``await wg.generate(prompts)``, then ``await wg.compute_log_prob(batch)``. It prints each response and
its summed log-prob, and checks them against the log-probs the sampler recorded while generating (the trainer and
the sampler must agree on the policy, or PPO's ratio is wrong from the first step); exits 1 if they disagree.
Without ``--model`` it first writes a checkpoint the way a user's would look: config.json, model.safetensors and a
tokenizer (tokenizer.json + tokenizer_config.json) in one directory. CPU only; about 30 s on a 2-core laptop.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

import orchestra as orc
from orchestra import Batch, ResourcePool, WorkerGroup

# Per-token tolerance between the trainer's and the sampler's log-probs. Both are fp32 on CPU and see the same
# weights; they differ only in how the sums inside attention and the matmuls are ordered (the sampler runs one
# token at a time against a KV cache, the trainer the whole sequence at once). Measured with this script: max
# |difference| 4.8e-7 per token (sampling is seeded, so every run gives the same); 1e-4 is a 200x margin. A real
# disagreement is far above it: a wrong temperature (0.7 vs 1) moves these log-probs by ~0.1, a response shifted
# by one token by ~1. The per-sequence sum is checked with TOL x its number of tokens.
TOL = 1e-4
PROMPTS = ["1+2=", "7+8=", "3+5=", "9+9="]


def save_tiny_checkpoint(directory: str) -> None:
    """A randomly initialized ~0.1 M-parameter Qwen2 and a character tokenizer, saved as a Hugging Face checkpoint
    directory (what ``from_pretrained`` reads, offline)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from engines.models import build_causal_lm, tiny_qwen2_config
    from engines.tokenizer import CharTokenizer

    chars = CharTokenizer()  # <pad> <bos> <eos>, then digits, + - * = ? and space: one token per character
    core = Tokenizer(models.WordLevel(vocab=chars.get_vocab(), unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", chars.bos_token_id)])
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  padding_side="left")
    tok.save_pretrained(directory)
    config = tiny_qwen2_config(vocab_size=chars.vocab_size, bos_token_id=chars.bos_token_id,
                               eos_token_id=chars.eos_token_id, pad_token_id=chars.pad_token_id)
    build_causal_lm(config, seed=0).save_pretrained(directory)  # config.json + model.safetensors


def compare(batch: Batch, scored: Batch, tol: float = TOL) -> tuple[list[tuple[int, float, float]], float, list[int]]:
    """Per row (response tokens, summed ``old_log_probs``, summed ``rollout_log_probs``), the largest per-token
    difference, and the rows whose sums differ by more than ``tol`` per token."""
    mask = batch["response_mask"].bool()
    mine = scored["old_log_probs"].masked_fill(~mask, 0.0)
    rollout = batch["rollout_log_probs"].masked_fill(~mask, 0.0)
    per_token = (mine - rollout).abs().max().item()
    sums, rollout_sums, lengths = mine.sum(-1).tolist(), rollout.sum(-1).tolist(), mask.sum(-1).tolist()
    rows = list(zip(lengths, sums, rollout_sums))
    bad = [i for i, (n, a, b) in enumerate(rows) if abs(a - b) > tol * max(1, n)]
    return rows, per_token, bad


async def main(model_dir: str) -> int:
    """Generate, score, print and check; returns the exit status (0: the log-probs agree)."""
    from transformers import AutoTokenizer

    from engines import EngineConfig, SamplingParams
    from engines.workers import ActorRolloutRefWorker

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if tok.pad_token is None:  # many causal LM tokenizers have none; prompts are left-padded (masked out anyway)
        tok.pad_token = tok.eos_token
    enc = tok(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    prompts = Batch.from_dict({"prompts": enc["input_ids"], "attention_mask": enc["attention_mask"],
                               "text": PROMPTS})
    sampling = SamplingParams(n=2, max_new_tokens=6, temperature=0.7)
    with orc.init():  # a private local Ray cluster on loopback
        async with WorkerGroup(ResourcePool(process_on_nodes=[2]), ActorRolloutRefWorker,
                               model_path=model_dir, tokenizer=model_dir, sampling=sampling, with_ref=False,
                               engine=EngineConfig(device="cpu"), rollout_dtype=torch.float32) as wg:
            batch = await wg.generate(prompts)           # 2 samples per prompt, rows split over the 2 ranks
            scored = await wg.compute_log_prob(batch)    # log-probs at the sampling temperature (0.7)

    rows, per_token, bad = compare(batch, scored)
    print(f"{'prompt':<6} {'response':<10} {'tokens':>6} {'log-prob':>10} {'sampler':>10}")
    for i, (tokens, mine, theirs) in enumerate(rows):
        ids = batch["responses"][i][batch["response_mask"][i].bool()].tolist()
        text = tok.decode(ids, skip_special_tokens=True)
        print(f"{batch['text'][i]:<6} {text!r:<10} {tokens:>6} {mine:>10.4f} {theirs:>10.4f}"
              f"{'  <- disagrees' if i in bad else ''}")
    print(f"max |compute_log_prob - rollout_log_probs| per token: {per_token:.2e} (tolerance {TOL:g})")
    if bad or per_token > TOL:
        print(f"FAIL: the trainer's log-probs disagree with the sampler's (rows {bad})", file=sys.stderr)
        return 1
    print("OK: compute_log_prob reproduces the sampler's log-probs")
    return 0


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a local Hugging Face checkpoint directory (default: a tiny random Qwen2 "
                                        "saved to a temp dir)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    if args.model:
        status = orc.run(main(os.path.abspath(args.model)))
    else:
        with tempfile.TemporaryDirectory(prefix="orchestra-tiny-qwen2-") as d:
            save_tiny_checkpoint(d)
            print(f"saved a tiny random Qwen2 checkpoint: {sorted(os.listdir(d))}")
            status = orc.run(main(d))
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(cli())
