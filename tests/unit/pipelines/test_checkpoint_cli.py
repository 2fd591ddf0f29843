"""``orchestra train`` never destroys a run: a second run into an output_dir with checkpoints is refused, and
``--resume`` checks the checkpoint before Ray starts; user errors come out as ``orchestra train: ...``, exit 2."""

from __future__ import annotations

import pytest
from cli_testutils import RayStarted, no_ray  # noqa: F401 - no_ray: a fixture the tests use
from cli_testutils import committed as _committed
from cli_testutils import train_args as _train

from pipelines.cli import main as cli_main

pytestmark = pytest.mark.usefixtures("no_ray")  # every test here must stop before the cluster starts


def test_second_run_into_the_same_output_dir_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    _committed(out)
    assert cli_main(_train(out)) == 2
    err = capsys.readouterr().err
    assert err.startswith("orchestra train: ") and "--resume" in err and "--overwrite" in err and str(out) in err
    assert "Traceback" not in err
    assert (out / "checkpoints" / "step_000001" / "runner.json").exists()  # nothing was deleted


def test_resume_without_a_checkpoint_fails_before_ray(tmp_path, capsys):
    assert cli_main(_train(tmp_path / "run", "--resume")) == 2
    err = capsys.readouterr().err
    assert err.startswith("orchestra train: --resume: runner.output_dir ") and "does not exist" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
    (tmp_path / "run").mkdir()
    assert cli_main(_train(tmp_path / "run", "--resume")) == 2
    err = capsys.readouterr().err
    assert err.startswith("orchestra train: --resume: no checkpoint under") and "Traceback" not in err


def test_resume_with_only_a_corrupt_checkpoint_names_the_file_before_ray(tmp_path, capsys):
    out = tmp_path / "run"
    d = _committed(out)
    (d / "runner.json").write_text('{"st')
    assert cli_main(_train(out, "--resume")) == 2
    err = capsys.readouterr().err
    assert err.startswith("orchestra train: ") and "runner.json" in err and "--overwrite" in err


def test_resume_with_a_good_checkpoint_gets_as_far_as_starting_ray(tmp_path):
    out = tmp_path / "run"
    _committed(out)
    with pytest.raises(RayStarted):
        cli_main(_train(out, "--resume"))


def test_overwrite_starts_over_keeping_other_files(tmp_path):
    out = tmp_path / "run"
    _committed(out)
    (out / "notes.md").write_text("mine")
    with pytest.raises(RayStarted):
        cli_main(_train(out, "--overwrite"))
    assert not (out / "checkpoints").exists() and (out / "notes.md").read_text() == "mine"


def test_resume_and_overwrite_exclude_each_other(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(_train(tmp_path, "--resume", "--overwrite"))
    assert e.value.code == 2
    assert "orchestra train: error:" in capsys.readouterr().err


def test_missing_config_file_is_a_cli_error(tmp_path, capsys):
    assert cli_main(["train", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("orchestra train: ") and "nope.yaml" in err


def test_resume_refusal_needs_neither_torch_nor_ray(tmp_path):
    import subprocess
    import sys

    code = ("import sys; from pipelines.cli import main; rc = main(sys.argv[1:]); "
            "print(rc, sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, *_train(tmp_path / "run", "--resume")],
                          capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[0] == "2 []"
    # (after the warning that the default warmup outlasts this 3-step run)
    assert done.stderr.splitlines()[-1].startswith("orchestra train: --resume: runner.output_dir ")


def test_a_warm_start_with_kl_is_refused_before_overwrite_deletes_anything(tmp_path, capsys):
    out = tmp_path / "run"
    _committed(out)
    argv = ["train", "algorithm.kl_coef=0.05", "task.params={warm_start_steps: 5}", *_train(out, "--overwrite")[1:]]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("orchestra train: task.params.warm_start_steps: 5 warm-start steps") and "Traceback" not in err
    assert (out / "checkpoints" / "step_000001" / "runner.json").exists()  # nothing was deleted


def test_a_task_builders_own_warm_start_with_kl_is_a_clean_error(tmp_path, capsys):
    from pipelines.tasks import digit_reward, register_task, registry
    from pipelines.taskspec import TaskSpec

    @register_task("warm_in_builder_cli_test", params=())
    def build(params):
        return TaskSpec(name="warm_in_builder_cli_test", records=[{"prompt": "1+1=", "answer": "2"}],
                        reward_fn=digit_reward, warm_start_steps=7, answer_pool=("2",))

    try:
        argv = ["train", "task.name=warm_in_builder_cli_test", "algorithm.kl_coef=0.05", *_train(tmp_path / "run")[1:]]
        assert cli_main(argv) == 2  # before Ray (the no_ray fixture would raise)
    finally:
        registry._REGISTRY.pop("warm_in_builder_cli_test", None)
    err = capsys.readouterr().err
    assert err.startswith("orchestra train: task.params.warm_start_steps: 7 warm-start steps") and "Traceback" not in err
