"""Shared setup for the core unit tests: one torch thread (the CI box has 2 cores); no Ray cluster is started."""

import torch

torch.set_num_threads(1)
