"""A batch one rank must refuse is refused on every rank before any collective: token ids outside the model's
vocabulary or not integers, a batch that is not a mapping of tensors, an explicit lr that is not a finite number > 0
(train_step), and for compute_log_prob an empty batch, missing model inputs or columns of the wrong shape (was: the
refusing rank raised alone, in its forward, before the first all-reduce or after it, and the other ranks waited for
it until the process group timed out)."""

from __future__ import annotations

import pytest
from dp_engine_testutils import refused_on_one_rank_worker
from engines_testutils import VOCAB, make_batch, model_factory

from engines._dist import spawn
from engines.fsdp import EngineConfig, FSDPEngine

pytestmark = pytest.mark.timeout(300)


def test_token_ids_outside_the_vocabulary_are_refused_naming_column_ids_and_vocabulary():
    engine = FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=4))
    batch = make_batch(B=4)
    batch["responses"][1, 2] = VOCAB + 3
    batch["input_ids"][1, batch["prompts"].shape[1] + 2] = VOCAB + 3
    with pytest.raises(ValueError, match=rf"compute_log_prob: column 'input_ids' on rank 0 holds token ids outside "
                                         rf"the model's vocabulary \[0, {VOCAB}\): \[{VOCAB + 3}\] at 1 position"):
        engine.compute_log_prob(batch)
    negative = make_batch(B=4)
    negative["prompts"][0, -1] = -1
    negative["input_ids"][0, negative["prompts"].shape[1] - 1] = -1
    with pytest.raises(ValueError, match=r"train_step: column 'input_ids' on rank 0 holds token ids outside .*\[-1\]"):
        engine.train_step(negative, lambda o, mb: (o["log_probs"].sum(), {}))
    assert engine.global_step == 0


@pytest.mark.parametrize("call", ["train_step", "compute_log_prob"])
def test_a_model_input_with_the_wrong_row_count_is_named_not_reported_missing(call):
    engine = FSDPEngine(model_factory(0), EngineConfig(micro_batch_size=4))
    batch = make_batch(B=4)
    batch["attention_mask"] = batch["attention_mask"][:3]
    run = {"train_step": lambda: engine.train_step(batch, lambda o, mb: (o["log_probs"].sum(), {})),
           "compute_log_prob": lambda: engine.compute_log_prob(batch)}[call]
    with pytest.raises(ValueError, match=rf"{call}: column 'attention_mask' has shape \(3, 14\) on rank 0; it must "
                                         rf"be \[rows, length\] with rows = 4"):
        run()


@pytest.mark.slow  # spawns ranks
def test_a_batch_refused_on_one_rank_stops_every_rank():
    r0, r1 = spawn(refused_on_one_rank_worker, 2)
    expect = {"train_step past the vocabulary": "holds token ids outside the model's vocabulary",
              "compute_log_prob past the vocabulary": "holds token ids outside the model's vocabulary",
              "compute_log_prob of an empty batch": "empty batch on rank 1",
              "compute_log_prob without responses": "batch needs 'responses'",
              "compute_log_prob of float ids": "column 'input_ids' on rank 1 holds torch.float32 values",
              "train_step of float ids": "column 'input_ids' on rank 1 holds torch.float32 values",
              "compute_log_prob of 1-D responses": "column 'responses' has shape (8,) on rank 1",
              "compute_log_prob of a short mask": "column 'response_mask' has shape (3, 7) on rank 1",
              "compute_log_prob of no batch": "rank 1 cannot read its batch",
              "train_step of no batch": "rank 1 cannot read its batch",
              "train_step at lr nan": "lr must be a finite number > 0, got nan (rank 1)"}
    for call, text in expect.items():
        assert text in r1[call] and "rank 1" in r1[call], (call, r1[call])
        assert "rank 1 refused its batch" in r0[call], (call, r0[call])
    assert r0["after"] == r1["after"] == "ok"
