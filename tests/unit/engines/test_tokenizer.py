"""CharTokenizer: code-defined char vocabulary, specials, padding, decoding."""

import pytest
import torch

from engines.tokenizer import CharTokenizer


@pytest.fixture(scope="module")
def tok():
    return CharTokenizer()


def test_special_ids_and_vocab(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.vocab_size == len(tok) == 3 + len("0123456789+-*=? ")
    assert len(set(tok.get_vocab().values())) == tok.vocab_size
    # ids are stable across instances (trainer and workers tokenise independently)
    assert CharTokenizer().get_vocab() == tok.get_vocab()


def test_encode_decode_roundtrip(tok):
    text = "12+7=19"
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    with_specials = tok.encode(text, add_bos=True, add_eos=True)
    assert with_specials[0] == tok.bos_token_id and with_specials[-1] == tok.eos_token_id
    assert tok.decode(with_specials) == text
    assert tok.decode(with_specials, skip_special_tokens=False) == "<bos>" + text + "<eos>"
    assert tok.decode(torch.tensor(with_specials)) == text


def test_unknown_char_and_bad_id_raise(tok):
    with pytest.raises(ValueError):
        tok.encode("3/4")
    with pytest.raises(ValueError):
        tok.decode([tok.vocab_size])


def test_truncate_at_eos(tok):
    ids = tok.encode("8") + [tok.eos_token_id] + tok.encode("99")
    assert tok.truncate_at_eos(ids) == tok.encode("8")
    assert tok.truncate_at_eos(tok.encode("12")) == tok.encode("12")


def test_batch_encode_left_and_right(tok):
    ids, mask = tok.batch_encode(["1+2=", "10+20="], padding_side="left")
    assert ids.shape == mask.shape == (2, 7) and ids.dtype == mask.dtype == torch.long
    assert mask.tolist() == [[0, 0, 1, 1, 1, 1, 1], [1] * 7]
    assert ids[0, :2].tolist() == [tok.pad_token_id] * 2 and ids[0, 2].item() == tok.bos_token_id
    assert tok.batch_decode(ids) == ["1+2=", "10+20="]

    ids_r, mask_r = tok.batch_encode(["1+2=", "10+20="], padding_side="right", add_bos=False, add_eos=True)
    assert mask_r.tolist() == [[1] * 5 + [0] * 2, [1] * 7]
    assert ids_r[0, 4].item() == tok.eos_token_id and ids_r[0, 5:].tolist() == [tok.pad_token_id] * 2
    with pytest.raises(ValueError):
        tok.batch_encode(["1"], padding_side="middle")


def test_batch_decode_keeps_specials_on_request(tok):
    ids, _ = tok.batch_encode(["7"], padding_side="left")
    assert tok.batch_decode(ids, skip_special_tokens=False) == ["<bos>7"]
