"""A tiny character-level tokenizer defined entirely in code (no downloads).

Used by the toy GRPO demo (digit arithmetic).  Every character is one token;
special tokens are ``<pad>`` (0), ``<bos>`` (1) and ``<eos>`` (2).

The vocabulary is fixed and ordered, so ids are stable across processes and
runs (important when a trainer and a rollout worker tokenise independently).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)

# Characters after the special tokens, in id order.
DEFAULT_CHARS: str = "0123456789+-*=? "


class CharTokenizer:
    """Character-level tokenizer with ``<pad>``, ``<bos>``, ``<eos>``.

    >>> tok = CharTokenizer()
    >>> tok.decode(tok.encode("3+4=", add_bos=True))
    '3+4='
    """

    def __init__(self, chars: str = DEFAULT_CHARS) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError("duplicate characters in tokenizer alphabet")
        self.chars = chars
        self.id_to_token: list[str] = list(SPECIAL_TOKENS) + list(chars)
        self.token_to_id: dict[str, int] = {t: i for i, t in enumerate(self.id_to_token)}
        self.pad_token_id: int = self.token_to_id[PAD_TOKEN]
        self.bos_token_id: int = self.token_to_id[BOS_TOKEN]
        self.eos_token_id: int = self.token_to_id[EOS_TOKEN]
        self.pad_token, self.bos_token, self.eos_token = PAD_TOKEN, BOS_TOKEN, EOS_TOKEN
        self.special_ids: frozenset[int] = frozenset(
            (self.pad_token_id, self.bos_token_id, self.eos_token_id)
        )

    # ------------------------------------------------------------------ basics
    @property
    def vocab_size(self) -> int:
        return len(self.id_to_token)

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return dict(self.token_to_id)

    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return f"CharTokenizer(vocab_size={self.vocab_size})"

    # --------------------------------------------------------------- encoding
    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Map ``text`` to ids, one per character. Unknown characters raise ``ValueError``."""
        ids: list[int] = [self.bos_token_id] if add_bos else []
        for ch in text:
            try:
                ids.append(self.token_to_id[ch])
            except KeyError:
                raise ValueError(f"character {ch!r} is not in the tokenizer vocabulary") from None
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        """Map ids back to text.

        With ``skip_special_tokens=True`` pad/bos/eos are dropped (decoding does
        *not* stop at eos; truncate first if you need that, see
        :meth:`truncate_at_eos`).
        """
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        out = []
        for i in ids:
            i = int(i)
            if skip_special_tokens and i in self.special_ids:
                continue
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} out of range [0, {self.vocab_size})")
            out.append(self.id_to_token[i])
        return "".join(out)

    def truncate_at_eos(self, ids: Sequence[int] | torch.Tensor) -> list[int]:
        """Return ``ids`` up to (excluding) the first ``<eos>``."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        ids = [int(i) for i in ids]
        if self.eos_token_id in ids:
            ids = ids[: ids.index(self.eos_token_id)]
        return ids

    def batch_encode(
        self,
        texts: Sequence[str],
        padding_side: str = "left",
        add_bos: bool = True,
        add_eos: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode and pad a batch. Returns ``(input_ids [B,T], attention_mask [B,T])`` (both int64)."""
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        encoded = [self.encode(t, add_bos=add_bos, add_eos=add_eos) for t in texts]
        max_len = max((len(e) for e in encoded), default=0)
        ids = torch.full((len(encoded), max_len), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(encoded), max_len), dtype=torch.long)
        for row, e in enumerate(encoded):
            if not e:
                continue
            if padding_side == "left":
                ids[row, max_len - len(e):] = torch.tensor(e, dtype=torch.long)
                mask[row, max_len - len(e):] = 1
            else:
                ids[row, : len(e)] = torch.tensor(e, dtype=torch.long)
                mask[row, : len(e)] = 1
        return ids, mask

    def batch_decode(
        self, batch_ids: Iterable[Iterable[int]] | torch.Tensor, skip_special_tokens: bool = True
    ) -> list[str]:
        if isinstance(batch_ids, torch.Tensor):
            batch_ids = batch_ids.tolist()
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in batch_ids]
