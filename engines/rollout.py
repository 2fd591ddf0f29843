"""Batched sampling with a KV cache, for rollouts.

:class:`RolloutEngine` wraps a plain (unsharded) Hugging Face causal LM. ``generate`` takes
left-padded prompts, samples ``n`` responses per prompt and returns the engines' batch layout
(see engines/__init__.py), rows prompt-major: sample j of prompt i is row ``i * n + j``.

``rollout_log_probs`` are the log-probs of the sampled tokens under the temperature-scaled
distribution ``log_softmax(logits / temperature)`` **before** top-k / top-p filtering, i.e. the
same quantity the trainer's ``compute_log_prob(temperature=...)`` computes (with greedy decoding,
``temperature=0``, they are taken at temperature 1). Tokens after a stop token are pad, with
``response_mask`` 0 and log-prob 0; the stop token itself is part of the response (mask 1).
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from engines._data import batch_rows, position_ids_from_mask, tensor_dict

__all__ = ["SamplingParams", "RolloutEngine"]

log = logging.getLogger("orchestra")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample.

    n: samples per prompt. max_new_tokens: response length cap.
    temperature: 0 means greedy. top_p: nucleus mass (1.0 = off). top_k: 0 = off.
    stop_token_ids: tokens that end a response (kept, mask 1); None = the engine's eos ids.
    seed: seeds a private torch.Generator (same seed + same inputs = same samples); None uses
        torch's global RNG.
    pad_to_max_new_tokens: always return R = max_new_tokens (otherwise R is the longest response).
    """

    n: int = 1
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] | None = None
    seed: int | None = None
    pad_to_max_new_tokens: bool = False

    def __post_init__(self) -> None:
        for name, low in (("n", 1), ("max_new_tokens", 1), ("top_k", 0)):
            v = getattr(self, name)
            if not _is_int(v) or v < low:
                extra = " (0 = off)" if name == "top_k" else ""
                raise ValueError(f"SamplingParams: {name} must be an integer >= {low}{extra}, got {v!r}")
        if not _is_real(self.temperature) or not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"SamplingParams: temperature must be a finite number >= 0 (0 = greedy), got "
                             f"{self.temperature!r}")
        if not _is_real(self.top_p) or not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams: top_p must be a finite number in (0, 1] (1 = off), got {self.top_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"SamplingParams: seed must be an integer or None, got {self.seed!r}")


def _is_int(v: Any) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    """A real number (int, float, numpy scalar), not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _as_id_tuple(x: Any) -> tuple[int, ...]:
    if x is None:
        return ()
    if isinstance(x, int):
        return (x,)
    return tuple(int(i) for i in x)


def filter_logits(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf (at least one stays)."""
    if top_k > 0 and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, idx = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        # drop a token when the mass of the tokens before it already reaches top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


class RolloutEngine:
    """Sampling engine over a plain causal LM (e.g. ``build_causal_lm(...)`` in bf16 on CUDA).

    The stop set ``eos_token_ids`` is ``eos_token_id`` (default: the model config's) followed by every id of the
    model's ``generation_config.eos_token_id`` (chat models list their end-of-turn ids there, as HF ``generate``
    stops at all of them), deduplicated in order. ``pad_token_id`` defaults to the model config's, then the
    generation config's, then the first stop id, then 0. With no stop id at all, responses always run to
    ``max_new_tokens``: the first ``generate`` that uses the empty set logs a WARNING. ``micro_batch_size``
    bounds the rows (after repeating prompts n times) generated together.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        eos_token_id: int | Iterable[int] | None = None,
        pad_token_id: int | None = None,
        micro_batch_size: int | None = None,
    ) -> None:
        self.model = model.eval()
        cfg = getattr(model, "config", None)
        gen_cfg = getattr(model, "generation_config", None)
        ids = _as_id_tuple(eos_token_id if eos_token_id is not None else getattr(cfg, "eos_token_id", None))
        self.eos_token_ids = tuple(dict.fromkeys(ids + _as_id_tuple(getattr(gen_cfg, "eos_token_id", None))))
        self._warned_no_stop = False
        if pad_token_id is None:
            pad_token_id = getattr(cfg, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = getattr(gen_cfg, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.pad_token_id = int(pad_token_id)
        self.micro_batch_size = micro_batch_size

    @property
    def device(self) -> torch.device:
        """Device of the model's parameters."""
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy weights (a full state dict, or an iterable of (name, tensor)) into the model, casting to its
        dtype/device. Returns the number of tensors copied.

        Every parameter must be covered, except tied ones (e.g. lm_head tied to the embedding). Everything is
        checked before the first copy (names, shapes, dtypes: a floating-point weight needs a floating-point
        tensor; another needs one that casts to it safely), so weights that are refused (KeyError for a name the
        model lacks or a weight not given, ValueError for a shape or dtype, TypeError for a non-tensor) leave the
        model as it was. An iterable is read whole before copying (its tensors are held until then).
        """
        items = list(weights.items() if isinstance(weights, Mapping) else weights)
        targets = dict(self.model.state_dict(keep_vars=True))
        unknown: list[str] = []
        for name, tensor in items:
            t = targets.get(name)
            if t is None:
                unknown.append(name)
                continue
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"load_weights: {name} is a {type(tensor).__name__}, not a tensor; pass the "
                                f"trainer's state dict (name -> tensor). Nothing was copied")
            if tuple(t.shape) != tuple(tensor.shape):
                raise ValueError(f"load_weights: {name} has shape {tuple(tensor.shape)}, the model expects "
                                 f"{tuple(t.shape)}; the weights are of another model config. Nothing was copied")
            castable = (tensor.is_floating_point() if t.is_floating_point()
                        else torch.can_cast(tensor.dtype, t.dtype))
            if not castable:
                raise ValueError(f"load_weights: {name} has dtype {tensor.dtype}, the model's is {t.dtype} (it "
                                 f"cannot be cast safely); pass the trainer's weights as they are. Nothing was copied")
        if unknown:
            raise KeyError(f"load_weights: names not in the rollout model ({len(unknown)}): {unknown[:5]}"
                           f"{'...' if len(unknown) > 5 else ''}; the weights are of another model. Nothing was copied")
        loaded = {name for name, _ in items}
        # parameters shared under several names count as loaded if any alias was
        by_id: dict[int, list[str]] = {}
        for name, t in targets.items():
            by_id.setdefault(id(t), []).append(name)
        missing = [names[0] for names in by_id.values() if not loaded.intersection(names)]
        if missing:
            raise KeyError(f"load_weights: no weights given for ({len(missing)}) {missing[:5]}"
                           f"{'...' if len(missing) > 5 else ''}; pass the full state dict. Nothing was copied")
        for name, tensor in items:
            t = targets[name]
            t.data.copy_(tensor.to(device=t.device, dtype=t.dtype), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return len(loaded)

    def _check_prompt_ids(self, prompts: torch.Tensor) -> None:
        """Prompt ids must be integers that index the model's embedding (as the trainer requires): float ids would
        be truncated by ``.long()`` silently, an id >= vocab fails in the embedding (a device assert on CUDA)."""
        if prompts.is_floating_point() or prompts.is_complex() or prompts.dtype == torch.bool:
            raise ValueError(f"generate: column 'prompts' holds {prompts.dtype} values; token ids must be integers "
                             f"(torch.long): pass the tokenizer's ids as they are")
        get = getattr(self.model, "get_input_embeddings", None)
        emb = get() if callable(get) else None
        vocab = getattr(emb, "num_embeddings", None)
        if vocab is None or prompts.numel() == 0:
            return
        bad = (prompts < 0) | (prompts >= int(vocab))
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            rows = sorted(set(bad.nonzero()[:, 0].tolist()))
            raise ValueError(f"generate: column 'prompts' row {row} holds token id {int(prompts[row, col])} outside "
                             f"the model's vocabulary [0, {int(vocab)}) (column {col}; {int(bad.sum())} such id(s) in "
                             f"row(s) {rows[:5]}{'...' if len(rows) > 5 else ''}); check the tokenizer matches the "
                             f"model")

    # ------------------------------------------------------------------ sampling
    def _sample(
        self, logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.float()
        if p.temperature == 0:
            tok = logits.argmax(-1)
            return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0]
        z = logits / p.temperature
        logp = torch.log_softmax(z, -1)
        probs = torch.softmax(filter_logits(z, p.top_k, p.top_p), -1)
        # exponential race (Gumbel-max): argmax p_i / E_i with E_i ~ Exp(1) samples i with
        # probability p_i; one RNG fill + argmax, much cheaper than torch.multinomial
        noise = torch.empty_like(probs).exponential_(1.0, generator=gen).clamp_min_(torch.finfo(probs.dtype).tiny)
        tok = (probs / noise).argmax(-1)
        return tok, logp.gather(-1, tok[:, None])[:, 0]

    def _generate_chunk(
        self,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        p: SamplingParams,
        stop: torch.Tensor,
        gen: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from transformers import DynamicCache

        B = prompts.shape[0]
        dev = prompts.device
        pos = position_ids_from_mask(prompt_mask)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=prompts,
            attention_mask=prompt_mask,
            position_ids=pos,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = out.cache
        next_pos = pos[:, -1:] + 1
        mask = prompt_mask
        finished = torch.zeros(B, dtype=torch.bool, device=dev)
        toks, lps, live = [], [], []
        for step in range(p.max_new_tokens):
            tok, lp = self._sample(out.logits[:, -1], p, gen)
            alive = ~finished
            tok = torch.where(alive, tok, torch.full_like(tok, self.pad_token_id))
            lp = torch.where(alive, lp, torch.zeros_like(lp))
            toks.append(tok)
            lps.append(lp)
            live.append(alive)
            if stop.numel():
                finished = finished | (alive & torch.isin(tok, stop))
            if step == p.max_new_tokens - 1 or bool(finished.all()):
                break
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=dev)], dim=1)
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=mask,
                position_ids=next_pos,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.cache
            next_pos = next_pos + 1
        return torch.stack(toks, 1), torch.stack(lps, 1), torch.stack(live, 1).to(torch.long)

    @torch.no_grad()
    def generate(
        self,
        batch: Mapping[str, Any],
        params: SamplingParams | None = None,
        *,
        generator: torch.Generator | None = None,
        **overrides: Any,
    ) -> TensorDict:
        """Sample responses for ``batch['prompts']`` [B, P] (left-padded) with its prompt
        ``attention_mask`` [B, P] (all ones if absent). ``overrides`` replace fields of ``params``.

        Returns a TensorDict [B*n] on CPU with prompts, responses, input_ids, attention_mask,
        response_mask, rollout_log_probs, plus every other [B, ...] tensor of ``batch`` repeated
        n times (prompt-major). An explicit ``generator`` wins over ``params.seed``.
        """
        p = replace(params or SamplingParams(), **overrides) if overrides else (params or SamplingParams())
        if "prompts" not in batch:
            raise KeyError(f"generate: batch needs 'prompts' [B, P] (left-padded), got keys {sorted(batch.keys())}")
        dev = self.device
        rows = batch_rows(batch)
        data = tensor_dict(batch, dev)
        prompts = data.pop("prompts")
        self._check_prompt_ids(prompts)
        prompts = prompts.long()
        prompt_mask = data.pop("attention_mask", None)
        if prompt_mask is None:
            prompt_mask = torch.ones_like(prompts)
        if prompt_mask.shape != prompts.shape:
            raise ValueError(
                f"generate: attention_mask {tuple(prompt_mask.shape)} must be the prompt mask, shaped like prompts {tuple(prompts.shape)}"
            )
        off = (prompt_mask != 0) & (prompt_mask != 1)
        if bool(off.any()):
            row, col = (int(i) for i in off.nonzero()[0])
            raise ValueError(f"generate: attention_mask row {row} holds {prompt_mask[row, col].item()} (column {col}); "
                             f"it must be 0/1 (1: a real prompt token, 0: left padding)")
        empty = (prompt_mask.sum(-1) == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"generate: a prompt has no real token (attention_mask row all 0): row {empty[0]} "
                             f"({len(empty)} such row(s)); drop the row or give it a prompt of at least one token")
        right = (prompt_mask[:, -1] == 0).nonzero().flatten().tolist()
        if right:
            raise ValueError(f"generate: prompts must be LEFT-padded (last column of attention_mask must be 1): row "
                             f"{right[0]} ({len(right)} such row(s)) is not; pad prompts on the left (tokenizer "
                             f"padding_side='left')")
        prompt_mask = prompt_mask.long()
        stop_ids = p.stop_token_ids if p.stop_token_ids is not None else self.eos_token_ids
        if p.stop_token_ids is None and not stop_ids and not self._warned_no_stop:
            self._warned_no_stop = True
            log.warning("RolloutEngine: no stop token (no eos_token_id given, none in the model's config or "
                        "generation_config): every response runs to max_new_tokens, padded with id %d. Pass "
                        "eos_token_id= to RolloutEngine (a tokenizer with an eos_token_id does it for the workers), "
                        "set the model config's eos_token_id, or pass SamplingParams(stop_token_ids=...)",
                        self.pad_token_id)
        stop = torch.tensor(list(stop_ids), dtype=torch.long, device=dev)
        gen = generator
        if gen is None and p.seed is not None:
            gen = torch.Generator(device=dev)
            gen.manual_seed(p.seed)

        prompts = prompts.repeat_interleave(p.n, 0)
        prompt_mask = prompt_mask.repeat_interleave(p.n, 0)
        extra = {k: v.repeat_interleave(p.n, 0) for k, v in data.items()}
        total = rows * p.n
        chunk = self.micro_batch_size or total
        parts = [
            self._generate_chunk(prompts[s : s + chunk], prompt_mask[s : s + chunk], p, stop, gen)
            for s in range(0, total, chunk)
        ]
        R = p.max_new_tokens if p.pad_to_max_new_tokens else max(t.shape[1] for t, _, _ in parts)

        def pad(x: torch.Tensor, value: float) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, R - x.shape[1]), value=value)

        responses = torch.cat([pad(t, self.pad_token_id) for t, _, _ in parts])
        log_probs = torch.cat([pad(lp, 0.0) for _, lp, _ in parts])
        response_mask = torch.cat([pad(m, 0) for _, _, m in parts])
        out = {
            **extra,
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.cat([prompt_mask, response_mask], 1),
            "response_mask": response_mask,
            "rollout_log_probs": log_probs,
        }
        return TensorDict({k: v.cpu() for k, v in out.items()}, batch_size=[total])
