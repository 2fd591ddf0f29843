"""User errors found before the cluster starts come out as ``orchestra train: <what, where, what to change>`` with
exit status 2, not as a traceback with exit status 1 (which the CLI documents as a run that diverged or a worker
that died)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from local_jobs import LOCAL_TINY

import orchestra
import pipelines.runner
from pipelines.cli import main as cli_main


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the cluster was started")

    monkeypatch.setattr(orchestra, "init", refuse)
    monkeypatch.setattr(pipelines.runner, "build_cluster", refuse)


def _train(capsys, out: Path, *overrides: str) -> tuple[int, str]:
    code = cli_main(["train", *LOCAL_TINY, f"runner.output_dir={out}", *overrides, "--no-progress"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_output_dir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("mine")
    code, err = _train(capsys, tmp_path / "afile")
    assert code == 2 and err.startswith("orchestra train: runner.output_dir: ") and "is a file" in err
    code, err = _train(capsys, tmp_path / "afile" / "sub")
    assert code == 2 and err.startswith("orchestra train: runner.output_dir: ") and str(tmp_path / "afile") in err
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_missing_train_path(tmp_path, capsys):
    code, err = _train(capsys, tmp_path / "run", f"data.train_path={tmp_path / 'missing.jsonl'}")
    assert code == 2 and err.startswith("orchestra train: data.train_path: ") and "does not exist" in err


def test_a_train_path_with_a_bad_row(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1="}\n')
    code, err = _train(capsys, tmp_path / "run", f"data.train_path={tmp_path / 'bad.jsonl'}")
    assert code == 2 and err.startswith("orchestra train: data.train_path: ") and "answer" in err


@pytest.mark.parametrize("source", ["task.params={num_prompts: 2}", "data.train_path"])
def test_fewer_records_than_a_batch(tmp_path, capsys, source):
    if source == "data.train_path":
        (tmp_path / "one.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
        source = f"data.train_path={tmp_path / 'one.jsonl'}"
    code, err = _train(capsys, tmp_path / "run", source)
    assert code == 2 and err.startswith("orchestra train: data.prompts_per_step: bad value 8;")
    assert source.split("=")[0].split("{")[0] in err


def test_a_vocabulary_smaller_than_the_tokenizer(tmp_path, capsys):
    code, err = _train(capsys, tmp_path / "run", "model.vocab_size=5")
    assert code == 2 and err.startswith("orchestra train: model.vocab_size: bad value 5;") and "tokenizer" in err


def test_the_config_path_is_a_directory(tmp_path, capsys):
    code = cli_main(["train", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"orchestra train: {tmp_path}: ") and "directory" in err
    assert "Traceback" not in err


def test_a_missing_config_file(tmp_path, capsys):
    code = cli_main(["train", str(tmp_path / "job.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"orchestra train: {tmp_path / 'job.yaml'}: ") and "does not exist" in err


def test_cuda_without_a_gpu_in_process(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = _train(capsys, tmp_path / "run", "resources.device=cuda")
    assert code == 2 and err.startswith("orchestra train: resources.device: ") and "resources.device=cpu" in err


async def test_a_job_the_cluster_cannot_place_is_a_user_error(tmp_path, monkeypatch):
    """On Ray the driver cannot know the nodes' GPUs before it attaches: the placement check at start names what is
    missing, as a config error (a restart's placement timeout stays a run failure)."""
    from orchestra import PlacementError
    from pipelines.config import ConfigError, load_config

    def cannot_place(*args, **kwargs):
        raise PlacementError("pool 'actor' needs {'GPU': 1.0}; no live node has it")

    monkeypatch.setattr(pipelines.runner, "build_cluster", cannot_place)
    runner = pipelines.runner.Runner(load_config(None, [*LOCAL_TINY, f"runner.output_dir={tmp_path}"]),
                                     progress=False)
    with pytest.raises(ConfigError, match=r"resources: the job's workers cannot be placed.*GPU"):
        await runner.run()
