"""Rewards: a registry of rule-based reward functions and a reward-model engine.

A rule-based reward is ``fn(response_texts, ground_truths, **kw) -> list[float]``, applied to a
whole batch at once. Register your own with ``@register_reward("name")`` and look them up with
:func:`get_reward`. Builtins: ``exact_match``, ``numeric_match``, ``regex_format``,
``boxed_match`` and ``think_answer_format``.

:class:`RewardModelEngine` scores prompt+response with a sequence-classification model
(``engines.models.build_reward_model``), pooling at the last real token of ``attention_mask``.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from tensordict import TensorDict
from torch import nn

from engines._data import batch_rows, position_ids_from_mask, tensor_dict

__all__ = [
    "RewardFn",
    "register_reward",
    "get_reward",
    "list_rewards",
    "last_number",
    "RuleRewardEngine",
    "RewardModelEngine",
]


class RewardFn(Protocol):
    """``fn(response_texts, ground_truths, **kw) -> list[float]`` (one score per response)."""

    def __call__(self, response_texts: Sequence[str], ground_truths: Sequence[str], **kw: Any) -> list[float]: ...


_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str, *, overwrite: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn`` under ``name`` (``overwrite=True`` to replace an existing one)."""

    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and not overwrite and _REGISTRY[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered; pick another name or pass overwrite=True")
        _REGISTRY[name] = fn
        return fn

    return deco


def get_reward(name: str) -> RewardFn:
    """The reward function registered as ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no reward named {name!r}; registered: {sorted(_REGISTRY)} (use @register_reward)") from None


def list_rewards() -> list[str]:
    """Names of all registered reward functions."""
    return sorted(_REGISTRY)


def _check_lengths(response_texts: Sequence[str], ground_truths: Sequence[str] | None, name: str) -> None:
    if ground_truths is not None and len(response_texts) != len(ground_truths):
        raise ValueError(
            f"{name}: {len(response_texts)} responses but {len(ground_truths)} ground truths; pass one per response"
        )


# ---------------------------------------------------------------------- builtins
@register_reward("exact_match")
def exact_match(
    response_texts: Sequence[str],
    ground_truths: Sequence[str],
    *,
    strip: bool = True,
    case_sensitive: bool = True,
    correct: float = 1.0,
    wrong: float = 0.0,
) -> list[float]:
    """``correct`` when the response equals the ground truth (after optional strip / casefold)."""
    _check_lengths(response_texts, ground_truths, "exact_match")

    def norm(s: str) -> str:
        s = s.strip() if strip else s
        return s if case_sensitive else s.casefold()

    return [correct if norm(r) == norm(g) else wrong for r, g in zip(response_texts, ground_truths)]


_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?")


def last_number(text: str) -> float | None:
    """The last number in ``text`` ("1,234.5", "-3", "2e3", ".5"), or None when there is none."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:  # pragma: no cover - the regex only matches parseable numbers
        return None


@register_reward("numeric_match")
def numeric_match(
    response_texts: Sequence[str],
    ground_truths: Sequence[str],
    *,
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
    correct: float = 1.0,
    wrong: float = 0.0,
) -> list[float]:
    """``correct`` when the last number in the response equals the last number in the ground
    truth (so "#### 72" works) within tolerance; ``wrong`` when either has no number."""
    _check_lengths(response_texts, ground_truths, "numeric_match")
    out = []
    for r, g in zip(response_texts, ground_truths):
        a, b = last_number(r), last_number(str(g))
        ok = a is not None and b is not None and math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol)
        out.append(correct if ok else wrong)
    return out


@register_reward("regex_format")
def regex_format(
    response_texts: Sequence[str],
    ground_truths: Sequence[str] | None = None,
    *,
    pattern: str,
    fullmatch: bool = True,
    flags: int = re.DOTALL,
    matched: float = 1.0,
    unmatched: float = 0.0,
) -> list[float]:
    """``matched`` when the response matches ``pattern`` (whole text, or anywhere with
    ``fullmatch=False``). Ground truths are ignored."""
    _check_lengths(response_texts, ground_truths, "regex_format")
    rx = re.compile(pattern, flags)
    test = rx.fullmatch if fullmatch else rx.search
    return [matched if test(r) else unmatched for r in response_texts]


_BOXED = re.compile(r"\\boxed\{")


def _last_boxed(text: str) -> str | None:
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i, depth = starts[-1], 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


@register_reward("boxed_match")
def boxed_match(
    response_texts: Sequence[str],
    ground_truths: Sequence[str],
    *,
    correct: float = 1.0,
    wrong: float = 0.0,
) -> list[float]:
    """``correct`` when the last ``\\boxed{...}`` of the response equals the ground truth
    (whitespace removed; numbers compared numerically)."""
    _check_lengths(response_texts, ground_truths, "boxed_match")
    out = []
    for r, g in zip(response_texts, ground_truths):
        box = _last_boxed(r)
        if box is None:
            out.append(wrong)
            continue
        a, b = re.sub(r"\s+", "", box), re.sub(r"\s+", "", str(g))
        ok = a == b
        if not ok:
            try:
                ok = math.isclose(float(a.replace(",", "")), float(b.replace(",", "")), rel_tol=1e-6, abs_tol=1e-9)
            except ValueError:
                ok = False
        out.append(correct if ok else wrong)
    return out


@register_reward("think_answer_format")
def think_answer_format(
    response_texts: Sequence[str],
    ground_truths: Sequence[str] | None = None,
    *,
    matched: float = 1.0,
    unmatched: float = 0.0,
) -> list[float]:
    """``matched`` for responses shaped ``<think>...</think>`` then ``<answer>...</answer>``."""
    return regex_format(
        response_texts,
        ground_truths,
        pattern=r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*",
        matched=matched,
        unmatched=unmatched,
    )


# ---------------------------------------------------------------------- engines
class RuleRewardEngine:
    """Applies a registered rule reward to a batch of token ids.

    ``tokenizer`` needs ``decode(ids) -> str``; responses are decoded up to their ``response_mask`` and cut at
    the tokenizer's ``eos_token_id`` (when it has one). The other special tokens (pad, bos, a chat template's
    markers) are what the policy wrote and stay in the text (``decode(..., skip_special_tokens=False)`` when the
    tokenizer's decode takes that argument): skipped, a pad sampled inside an answer made ``1<pad>8`` read as
    ``18``. Every score must be a
    finite float: a NaN or infinite one is a ``ValueError`` naming ``task`` (the job's ``task.name``, when given),
    the reward and the first bad response, since it would otherwise turn the step's advantages, loss and metrics
    into NaN without stopping the run.
    """

    def __init__(self, name: str, tokenizer: Any, *, task: str | None = None, **kw: Any) -> None:
        self.fn = get_reward(name)
        self.name = name
        self.task = task
        self.tokenizer = tokenizer
        self.kw = kw
        self._eos = getattr(tokenizer, "eos_token_id", None)
        self._decode_kw = {"skip_special_tokens": False} if _takes(tokenizer.decode, "skip_special_tokens") else {}

    def decode_responses(self, batch: Mapping[str, Any]) -> list[str]:
        """Response texts of the batch: masked tokens dropped, cut at the first ``<eos>``, other special tokens
        kept (the class docstring says why)."""
        responses = batch["responses"].cpu()
        mask = (batch["response_mask"].cpu().bool() if "response_mask" in batch
                else torch.ones_like(responses, dtype=torch.bool))
        texts = []
        for r, m in zip(responses, mask):
            ids = r[m].tolist()
            if self._eos is not None and self._eos in ids:
                ids = ids[: ids.index(self._eos)]
            texts.append(self.tokenizer.decode(ids, **self._decode_kw))
        return texts

    def score(self, batch: Mapping[str, Any], ground_truths: Sequence[str]) -> TensorDict:
        """``scores`` [B] (float32) and ``token_level_scores`` [B, R] (score at the last valid response token:
        the last position where response_mask is 1, holes allowed)."""
        texts = self.decode_responses(batch)
        who = f"task {self.task!r}: reward {self.name!r}" if self.task else f"reward {self.name!r}"
        scores = _scores_tensor(self.fn(texts, ground_truths, **self.kw), len(texts), who)
        bad = torch.nonzero(~torch.isfinite(scores)).flatten().tolist()
        if bad:
            i = bad[0]
            raise ValueError(
                f"{who} returned {scores[i].item()} for {len(bad)} of {len(texts)} responses (first at row {i}: "
                f"response {texts[i]!r}, answer {ground_truths[i]!r}); a reward must be a finite float for every "
                "response, or the step's advantages, loss and metrics turn into NaN: fix the reward function "
                "(e.g. return 0.0 for a response it cannot score)")
        mask = batch["response_mask"].cpu() if "response_mask" in batch else torch.ones_like(batch["responses"].cpu())
        return TensorDict(
            {"scores": scores, "token_level_scores": _place_at_last(scores, mask)}, batch_size=[len(texts)]
        )


def _scores_tensor(raw: Any, n: int, who: str) -> torch.Tensor:
    """A reward function's output as ``[n]`` float32: one number per response (a sequence or a 1-d tensor), else a
    ValueError naming ``who`` (task and reward), the count expected and what came back."""
    fix = (f"; a reward function gets the {n} decoded responses and their answers and must return a list of {n} "
           f"floats, in the same order")
    if isinstance(raw, torch.Tensor) and raw.dim() == 0:
        raise ValueError(f"{who} must return one score per response ({n}), got a 0-d tensor ({raw.item()!r})" + fix)
    try:
        scores = torch.as_tensor(raw, dtype=torch.float32) if isinstance(raw, torch.Tensor) else (
            torch.tensor(raw, dtype=torch.float32))
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{who} must return one score per response ({n}), got a {type(raw).__name__} that is not "
                         f"a sequence of numbers ({e})" + fix) from e
    if scores.dim() == 0:
        raise ValueError(f"{who} must return one score per response ({n}), got a {type(raw).__name__} "
                         f"({raw!r})" + fix)
    if scores.dim() != 1:
        raise ValueError(f"{who} must return one score per response ({n}), got shape {tuple(scores.shape)}" + fix)
    if scores.shape[0] != n:
        raise ValueError(f"{who} must return one score per response ({n}), got {scores.shape[0]} scores" + fix)
    return scores


def _takes(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` accepts keyword ``name`` (or any keyword)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: do not pass what it may refuse
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _place_at_last(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Each row's score on its last valid response token (the last position where ``response_mask`` is set, so a
    mask with holes works, as in ``pipelines.algorithms.outcome_to_token_scores``) -> ``[B, R]`` float32 on CPU;
    a row without a valid token gets all zeros."""
    keep = response_mask.bool().cpu()
    last = keep.shape[-1] - 1 - keep.flip(-1).to(torch.int8).argmax(-1)
    out = torch.zeros(keep.shape, dtype=torch.float32)
    out[torch.arange(len(scores)), last] = scores.float().cpu()
    return torch.where(keep, out, torch.zeros_like(out))


class RewardModelEngine:
    """Scores prompt+response with a sequence-classification model (one label).

    The score is the head output at the last position where ``attention_mask`` is 1 (robust to
    any padding side and to pad ids that occur in the text): a forward hook on the model's
    ``score`` head captures the per-token outputs of an ordinary forward, so an FSDP-wrapped
    model works too. Inputs go to the model's device. If the config has no ``pad_token_id``,
    it is set to 0 (transformers refuses batches otherwise; its own pooling is not used).
    """

    def __init__(self, model: nn.Module, *, micro_batch_size: int = 16) -> None:
        config = getattr(model, "config", None)
        if getattr(config, "num_labels", 1) != 1:
            raise ValueError("RewardModelEngine needs a model with num_labels=1 (engines.models.build_reward_model)")
        head = getattr(model, "score", None)
        if not isinstance(head, nn.Module):
            raise TypeError(f"{type(model).__name__} has no 'score' head; use a *ForSequenceClassification model")
        if config is not None and getattr(config, "pad_token_id", 0) is None:
            config.pad_token_id = 0
        self.model = model.eval()
        self.micro_batch_size = micro_batch_size
        self._captured: list[torch.Tensor] = []
        head.register_forward_hook(lambda _m, _inp, out: self._captured.append(out))

    @property
    def device(self) -> torch.device:
        """Device of the model's parameters."""
        return next(self.model.parameters()).device

    @torch.no_grad()
    def score(self, batch: Mapping[str, Any]) -> TensorDict:
        """``scores`` [B] and ``token_level_scores`` [B, R] (the score placed at the last valid response
        token, where response_mask is last 1) for a batch with input_ids (or prompts+responses) and attention_mask."""
        rows = batch_rows(batch)
        data = tensor_dict(batch, self.device, ["prompts", "responses", "input_ids", "attention_mask", "response_mask"])
        if "input_ids" not in data:
            if "prompts" not in data or "responses" not in data:
                raise KeyError("RewardModelEngine.score: batch needs 'input_ids' or 'prompts' + 'responses'")
            data["input_ids"] = torch.cat([data["prompts"], data["responses"]], 1)
        if "attention_mask" not in data:
            raise KeyError("RewardModelEngine.score: batch needs 'attention_mask' [B, P+R]")
        parts = []
        for s in range(0, rows, self.micro_batch_size):
            ids = data["input_ids"][s : s + self.micro_batch_size]
            am = data["attention_mask"][s : s + self.micro_batch_size]
            self._captured.clear()
            self.model(input_ids=ids, attention_mask=am, position_ids=position_ids_from_mask(am), use_cache=False)
            per_token = self._captured[-1][..., 0]  # [b, T]
            self._captured.clear()
            last = (am.shape[1] - 1) - am.flip(-1).long().argmax(-1)  # last index with mask 1
            parts.append(per_token[torch.arange(ids.shape[0], device=ids.device), last].float())
        scores = torch.cat(parts).cpu()
        bad = torch.nonzero(~torch.isfinite(scores)).flatten().tolist()
        if bad:  # a diverged or broken reward model: refuse rather than train on NaN advantages
            raise ValueError(f"RewardModelEngine.score: the reward model gave {scores[bad[0]].item()} for {len(bad)} "
                             f"of {rows} rows (first at row {bad[0]}); scores must be finite: check the reward "
                             "model's weights and dtype")
        out: dict[str, torch.Tensor] = {"scores": scores}
        if "response_mask" in data:
            out["token_level_scores"] = _place_at_last(scores, data["response_mask"].cpu())
        return TensorDict(out, batch_size=[rows])
