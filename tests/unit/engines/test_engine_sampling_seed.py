"""A seed set in the workers' SamplingParams is the base seed of their generate calls (it used to be replaced by
None and ignored): the same as passing ``seed=`` per call, which still wins over it; without either, the worker's
own seed is the base, as before."""

from __future__ import annotations

import pytest
import torch

from engines.rollout import SamplingParams
from engines.rollout_worker import RolloutWorker
from engines.tokenizer import CharTokenizer
from engines.workers import ActorRolloutRefWorker
from orchestra import Batch, ResourcePool, WorkerGroup

TOK = CharTokenizer()


def _prompts() -> Batch:
    ids, mask = TOK.batch_encode(["1+1=", "22+3="], padding_side="left", add_bos=True)
    return Batch.from_dict({"prompts": ids, "attention_mask": mask})


async def _responses(cls: type, sampling_seed: int | None, **call_kw) -> torch.Tensor:
    kw = {"with_ref": False} if cls is ActorRolloutRefWorker else {}
    sp = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=sampling_seed, stop_token_ids=())
    async with WorkerGroup(ResourcePool(process_on_nodes=[1], cpus_per_worker=0.01, backend="local"), cls,
                           dict(vocab_size=TOK.vocab_size), seed=0, sampling=sp, tokenizer=TOK, **kw) as g:
        out = await g.generate(_prompts(), **call_kw)
    return out["responses"]


@pytest.mark.parametrize("cls", [RolloutWorker, ActorRolloutRefWorker])
async def test_sampling_params_seed_is_the_base_seed(cls):
    one, two = await _responses(cls, 1), await _responses(cls, 2)
    assert not torch.equal(one, two), "SamplingParams.seed is ignored"
    assert torch.equal(one, await _responses(cls, None, seed=1))  # the same as seed=1 per call
    assert torch.equal(two, await _responses(cls, 1, seed=2))  # a per-call seed wins
    assert torch.equal(await _responses(cls, None), await _responses(cls, 0))  # default: the worker's seed (0)
