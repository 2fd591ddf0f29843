"""Helpers for the CLI tests that must stop before Ray starts: what a refused run may not get past, a committed
checkpoint of a fake run, and the ``orchestra train`` arguments of a tiny run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import orchestra
from pipelines import checkpoint as ckpt


class RayStarted(Exception):
    """Raised instead of starting Ray: the run got past every check into starting its cluster."""


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """``orchestra.init`` raises :class:`RayStarted`: a test sees how far a run got without starting a cluster."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise RayStarted("orchestra.init was called")

    monkeypatch.setattr(orchestra, "init", refuse)


def committed(out: Path, step: int = 1) -> Path:
    """A committed checkpoint after ``step`` in ``out/checkpoints`` (its runner.json holds only the step)."""
    d = ckpt.stage(out / "checkpoints", step)
    (d / "runner.json").write_text(json.dumps({"step": step}))
    return ckpt.commit(d, keep=3)


def train_args(out: Path, *flags: str) -> list[str]:
    """``orchestra train`` arguments of a 3-step run into ``out``, plus ``flags``."""
    return ["train", f"runner.output_dir={out}", "runner.total_steps=3", "--no-progress", *flags]
