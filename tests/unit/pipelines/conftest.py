"""Shared setup for the pipelines unit tests: one torch thread (the CI box has 2 cores)."""

import torch

torch.set_num_threads(1)
