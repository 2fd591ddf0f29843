"""The advantage workers' recipe endpoints, called as plain methods on a hand-made batch: REINFORCE++ returns with
the KL in the reward, moments of per-sequence advantages, the KL measurement and response lengths."""

import pytest
import torch

from orchestra import Batch
from pipelines.advantage_worker import AdvantageWorker


@pytest.fixture
def worker_and_batch():
    w = AdvantageWorker.__new__(AdvantageWorker)  # no process: the endpoints are plain methods
    b = Batch.from_dict({"token_level_scores": torch.tensor([[0.0, 1.0], [0.0, 7.0]]),
                         "response_mask": torch.tensor([[1, 1], [1, 0]]),
                         "old_log_probs": torch.zeros(2, 2), "ref_log_probs": torch.full((2, 2), -0.5),
                         "advantages": torch.tensor([1.0, -1.0])})
    return w, b


def test_reinforce_pp_returns_include_the_kl_penalty(worker_and_batch):
    # k1 = old - ref = 0.5 per token, x 0.1 = 0.05: rewards row 0 [-0.05, 0.95] -> G = [0.9, 0.95];
    # row 1 [-0.05] (the 7 is padding) -> G = [-0.05]
    w, b = worker_and_batch
    adv = AdvantageWorker.reinforce_pp(w, b, gamma=1.0, kl_coef=0.1, kl_estimator="k1")["advantages"]
    assert adv.tolist() == [pytest.approx([0.9, 0.95]), pytest.approx([-0.05, 0.0])]


def test_moments_count_a_per_sequence_advantage_once_per_valid_token(worker_and_batch):
    # advantages [1, -1] on rows of 2 and 1 valid tokens: values 1, 1, -1 -> sum 1, sumsq 3, count 3
    w, b = worker_and_batch
    assert AdvantageWorker.moments(w, b) == {"sum": 1.0, "sumsq": 3.0, "count": 3.0}


def test_kl_moments_and_response_lengths(worker_and_batch):
    # k1 0.5 on each of the 3 valid tokens: sum 1.5, count 3; lengths [2, 1]
    w, b = worker_and_batch
    assert AdvantageWorker.kl_moments(w, b) == {"sum": 1.5, "count": 3.0}
    assert AdvantageWorker.response_lengths(w, b)["response_length"].tolist() == [2, 1]


def test_moments_leave_out_rows_whose_advantage_is_masked(worker_and_batch):
    # DAPO's filler rows (advantage_mask 0) are not part of the batch whose advantages are whitened: only row 0's
    # two tokens count (value 1 each)
    w, b = worker_and_batch
    b = Batch.from_dict({"response_mask": b["response_mask"], "advantages": b["advantages"],
                         "advantage_mask": torch.tensor([1.0, 0.0])})
    assert AdvantageWorker.moments(w, b) == {"sum": 2.0, "sumsq": 2.0, "count": 2.0}
