"""A run owns its ``runner.output_dir`` and leaves it telling the truth. Each test here reproduces a defect that was
silent: two runs into one output_dir both ran (interleaved metrics.jsonl, ``latest`` naming whichever wrote last);
a resume left the redone steps' TensorBoard events in place (each logged twice); --overwrite kept the earlier run's
tensorboard/, reward.png and trace.json; runner.metrics=false on a resume kept metrics.jsonl lines of undone steps
and the CLI still said "metrics in ..."; an interrupted run did not say which checkpoint a resume restarts from.
Ray-free: the CLI's cluster start is replaced by an exception, runs are faked where a run is needed."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_testutils import RayStarted, no_ray  # noqa: F401 - no_ray: a fixture the tests use
from cli_testutils import committed as _committed
from cli_testutils import train_args as _train

import orchestra
from pipelines import checkpoint as ckpt
from pipelines.checkpoint import CheckpointError
from pipelines.cli import main as cli_main
from pipelines.metrics import MetricsSink, read_metrics

ROOT = Path(__file__).resolve().parents[3]
LOCK_NAME = ".orchestra.lock"  # the lock file a run holds in its output_dir (docs/checkpoints.md)
BOUND_S = 120  # a bound on a hung helper process, not a timing threshold


_RAW_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True)
sys.stdin.read()
"""

_RUN_HOLDER = """
import sys
from pathlib import Path
from pipelines.checkpoint import lock_output_dir
with lock_output_dir(Path(sys.argv[1]), run=True):
    print("held", flush=True)
    sys.stdin.read()
"""


@contextlib.contextmanager
def _holder(code: str, arg: Path) -> Iterator[subprocess.Popen]:
    """Another process holding the output_dir's lock until the block ends (or the test kills it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code, str(arg)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        line = proc.stdout.readline()  # blocks until the holder has the lock (or died)
        if line.strip() != "held":
            proc.kill()
            pytest.fail(f"the holder did not take the lock: {proc.communicate(timeout=BOUND_S)[1]}")
        yield proc
    finally:
        if proc.poll() is None:
            proc.stdin.close()
            proc.wait(timeout=BOUND_S)


def _held_by_someone(out: Path) -> bool:
    """Whether the output_dir's lock is held, asked through an open file of its own (flock locks belong to the open
    file, so this conflicts with a holder in this process too)."""
    fd = os.open(out / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


# --------------------------------------------------------------------------------------------- 1. one run at a time
def test_a_second_cli_run_into_a_running_runs_output_dir_fails_at_once_and_removes_nothing(tmp_path, no_ray, capsys):
    out = tmp_path / "run"
    _committed(out)
    (out / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    with _holder(_RAW_HOLDER, out / LOCK_NAME):
        assert cli_main(_train(out, "--overwrite")) == 2  # was: removed the running run's checkpoints, then ran
        assert cli_main(_train(out, "--resume")) == 2
    err = capsys.readouterr().err
    assert err.startswith("orchestra train: ") and "Traceback" not in err
    assert str(out) in err and "another run" in err and "choose another runner.output_dir" in err
    assert (out / "checkpoints" / "step_000001" / "runner.json").is_file()  # nothing was removed
    assert (out / "metrics.jsonl").read_text().count("step") == 2
    with pytest.raises(RayStarted):  # the holder is gone: the directory is free again
        cli_main(_train(out, "--overwrite"))


@pytest.mark.parametrize("bad", ["data.prompts_per_step=100000", "resources.device=cuda resources.backend=local"])
def test_overwrite_with_a_config_the_checks_refuse_removes_nothing_of_the_earlier_run(tmp_path, no_ray, capsys, bad):
    """--overwrite removed the earlier run's checkpoints and metrics, then the run was refused for a typo in the
    command (the config's checks came after the removal): the earlier run was lost and nothing started."""
    out = tmp_path / "run"
    _committed(out)
    (out / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    assert cli_main(["train", f"runner.output_dir={out}", "runner.total_steps=3", *bad.split(), "--no-progress",
                     "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("orchestra train: ") and bad.split("=")[0] in err and "removed" not in err
    assert (out / "checkpoints" / "step_000001" / "runner.json").is_file()
    assert (out / "metrics.jsonl").read_text().count("step") == 2
    with pytest.raises(RayStarted):  # a config the checks pass: removed, then the run starts
        cli_main(_train(out, "--overwrite"))
    assert not (out / "checkpoints" / "step_000001").exists() and not (out / "metrics.jsonl").exists()


def test_the_refusal_names_the_holder_and_a_crashed_holder_frees_the_directory(tmp_path):
    out = tmp_path / "run"
    with _holder(_RUN_HOLDER, out) as proc:
        with pytest.raises(CheckpointError) as e:
            with ckpt.lock_output_dir(out, run=True):
                pytest.fail("took a lock another process holds")
        msg = str(e.value)
        assert f"pid {proc.pid}" in msg and socket.gethostname() in msg and str(out) in msg
        assert "wait for it" in msg and "choose another runner.output_dir" in msg
        proc.kill()  # a crash: the kernel drops the lock with the process
        proc.wait(timeout=BOUND_S)
    with ckpt.lock_output_dir(out, run=True):
        assert _held_by_someone(out)
    assert not _held_by_someone(out)


def test_the_cli_hands_the_directory_to_its_run_but_two_runs_in_one_process_conflict(tmp_path):
    out = tmp_path / "run"
    with ckpt.lock_output_dir(out):  # the CLI's hold, from before its checks
        with ckpt.lock_output_dir(out, run=True):  # the Runner's, in the same process: the same hold
            assert _held_by_someone(out)
            with pytest.raises(CheckpointError, match=r"another run in this process.*choose another runner.output_dir"):
                with ckpt.lock_output_dir(out, run=True):
                    pytest.fail("two runs in one process shared an output_dir")
        assert _held_by_someone(out)  # still the CLI's until it lets go
    assert not _held_by_someone(out)


def test_overwrite_keeps_the_lock_file(tmp_path):
    out = tmp_path / "run"
    _committed(out)
    with ckpt.lock_output_dir(out, run=True):
        assert ckpt.prepare_output_dir(out, resume=False, overwrite=True) is None
        assert (out / LOCK_NAME).is_file() and _held_by_someone(out)


async def test_a_programmatic_runner_takes_the_lock_before_it_checks_or_removes_anything(tmp_path, monkeypatch):
    from pipelines.config import load_config
    from pipelines.runner import Runner

    out = tmp_path / "run"
    _committed(out)
    monkeypatch.setattr(orchestra, "init", lambda *a, **k: pytest.fail("the run started"))
    cfg = load_config(None, [f"runner.output_dir={out}"])
    me = types.SimpleNamespace(cfg=cfg, out=out, resume=False, overwrite=True, _resume_from=None)
    with _holder(_RAW_HOLDER, out / LOCK_NAME):
        with pytest.raises(CheckpointError, match="another run"):
            await Runner.run(me)
    assert (out / "checkpoints" / "step_000001" / "runner.json").is_file()


async def test_a_runner_holds_the_directory_through_its_cleanup(tmp_path, monkeypatch):
    import pipelines.runner as runner_mod
    from pipelines.config import load_config
    from pipelines.runner import Runner

    seen: dict[str, bool] = {}

    class Cluster:
        async def ready(self) -> None:
            seen["ready"] = _held_by_someone(tmp_path)
            raise RuntimeError("the run's error")

        def groups(self) -> list:
            return []

        def shutdown(self) -> None:
            seen["shutdown"] = _held_by_someone(tmp_path)

    monkeypatch.setattr(runner_mod.orc, "init", lambda *a, **k: None)
    monkeypatch.setattr(runner_mod, "build_cluster", lambda cfg, task: Cluster())
    r = Runner(load_config(None, [f"runner.output_dir={tmp_path}"]), progress=False)
    with pytest.raises(RuntimeError, match="the run's error"):
        await r.run()
    assert seen == {"ready": True, "shutdown": True}
    assert not _held_by_someone(tmp_path)


# ------------------------------------------------------------------------------ 2. TensorBoard on resume / overwrite
class _FakeWriter:
    made: list[_FakeWriter] = []

    def __init__(self, log_dir: str, purge_step: int | None = None) -> None:
        self.log_dir, self.purge_step, self.closed, self.scalars = log_dir, purge_step, False, []
        _FakeWriter.made.append(self)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_tensorboard(monkeypatch):
    _FakeWriter.made = []
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=_FakeWriter))
    return _FakeWriter.made


def test_a_resume_and_a_restart_purge_the_redone_steps_from_tensorboard(tmp_path, fake_tensorboard):
    MetricsSink(tmp_path, tensorboard=True).close()  # a fresh run: nothing to purge
    sink = MetricsSink(tmp_path, tensorboard=True, truncate_after=4)  # a resume from the checkpoint after step 4
    sink.write({"step": 5, "x": 1.0})
    sink.truncate(2)  # a restart from the checkpoint after step 2: steps 3.. are redone
    sink.write({"step": 3, "x": 2.0})
    sink.close()
    assert [w.purge_step for w in fake_tensorboard] == [None, 5, 3]
    assert all(w.closed for w in fake_tensorboard)
    assert fake_tensorboard[1].scalars == [("x", 1.0, 5)] and fake_tensorboard[2].scalars == [("x", 2.0, 3)]


def test_a_resume_shows_each_step_once_in_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsSink(tmp_path, tensorboard=True)
    for s in range(5):
        first.write({"step": s, "x": float(s)})
    first.close()
    resumed = MetricsSink(tmp_path, tensorboard=True, truncate_after=1)  # steps 2.. are redone
    for s in range(2, 4):
        resumed.write({"step": s, "x": 10.0 + s})
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("x")] == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]


def _earlier_run(out: Path) -> None:
    """What a finished run of the runner leaves in ``out``, besides checkpoints."""
    (out / "tensorboard").mkdir(parents=True)
    (out / "tensorboard" / f"events.out.tfevents.1700000000.{socket.gethostname()}.1.0").write_bytes(b"events")
    (out / "reward.png").write_bytes(b"png")
    (out / "trace.json").write_text("{}")
    (out / "trace.before-restart-1.json").write_text("{}")
    (out / "config.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 0}\n')


def test_overwrite_removes_every_output_of_the_earlier_run_and_nothing_else(tmp_path):
    _committed(tmp_path)
    _earlier_run(tmp_path)
    (tmp_path / "tensorboard" / "my_notes.txt").write_text("mine")
    (tmp_path / "my_analysis.csv").write_text("a,b\n")
    (tmp_path / "trace.mine.json").write_text("{}")
    assert ckpt.prepare_output_dir(tmp_path, resume=False, overwrite=True) is None
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == ["my_analysis.csv", "tensorboard", "tensorboard/my_notes.txt", "trace.mine.json"]


def test_overwrite_removes_an_emptied_tensorboard_directory(tmp_path):
    _earlier_run(tmp_path)
    assert ckpt.prepare_output_dir(tmp_path, resume=False, overwrite=True) is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("left", ["tensorboard/events.out.tfevents.1700000000.host.1.0", "reward.png", "trace.json",
                                  "trace.before-restart-2.json"])
def test_a_fresh_run_refuses_any_output_of_an_earlier_run_unless_overwrite(tmp_path, left):
    p = tmp_path / left
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"x")
    with pytest.raises(CheckpointError, match=rf"{Path(left).name} of an earlier run.*--overwrite"):
        ckpt.prepare_output_dir(tmp_path, resume=False, overwrite=False)
    assert p.read_bytes() == b"x"
    (tmp_path / "config.json").write_text("{}")  # every run rewrites it first: no earlier run by itself
    assert ckpt.prepare_output_dir(tmp_path, resume=False, overwrite=True) is None
    assert ckpt.prepare_output_dir(tmp_path, resume=False, overwrite=False) is None


# ----------------------------------------------------------------------------------- 3. runner.metrics=false honesty
def test_metrics_off_on_a_resume_still_drops_the_lines_of_the_undone_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)))
    sink = MetricsSink(tmp_path, truncate_after=1, enabled=False)
    sink.write({"step": 2, "x": 1.0})
    sink.event({"event": "restart", "step": 2})
    sink.truncate(0)
    sink.close()
    assert [r["step"] for r in read_metrics(path)] == [0]  # what is left describes steps that stand


@pytest.mark.parametrize("metrics", [True, False])
def test_the_cli_claims_only_the_metrics_it_wrote(tmp_path, monkeypatch, capsys, metrics):
    import pipelines.runner as runner_mod

    monkeypatch.setattr(runner_mod, "run", lambda cfg, **kw: [{"step": 0, "reward/mean": 0.5}])
    assert cli_main(["train", f"runner.output_dir={tmp_path}", f"runner.metrics={str(metrics).lower()}",
                     "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert said.startswith("done: 1 steps, last reward/mean 0.500")
    assert (f"metrics in {tmp_path}/metrics.jsonl" in said) is metrics
    if not metrics:
        assert "runner.metrics=false" in said


def test_a_run_whose_algorithm_logs_no_reward_mean_still_ends_well(tmp_path, monkeypatch, capsys):
    """The closing line read history[-1]['reward/mean'] and raised KeyError (exit 1, a traceback) after a run that
    had finished, when its algorithm logged no reward/mean."""
    import pipelines.runner as runner_mod

    monkeypatch.setattr(runner_mod, "run", lambda cfg, **kw: [{"step": 0, "actor/loss": 0.5}])
    assert cli_main(["train", f"runner.output_dir={tmp_path}", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("done: 1 steps, no reward/mean logged; metrics in ")


# ---------------------------------------------------------------------------------------- 4. what a resume restarts
def _interrupted(out: Path, next_step: int) -> str:
    from pipelines.runner import _SignalStop

    stop = _SignalStop()
    stop.runner = types.SimpleNamespace(out=out, cluster=object(), next_step=next_step)
    stop.signum = signal.SIGTERM
    return str(stop._interrupted())


def test_the_interrupted_message_names_the_checkpoint_a_resume_restarts_from(tmp_path):
    _committed(tmp_path, 3)
    newest = _committed(tmp_path, 5)
    msg = _interrupted(tmp_path, 8)
    assert msg.startswith("interrupted (SIGTERM) at step 8; ") and msg.endswith("; resume with --resume")
    assert str(newest) in msg and "after step 5" in msg and "steps 6-7 are run again" in msg
    assert "step 6 is run again" in _interrupted(tmp_path, 7)
    assert "no step is run again" in _interrupted(tmp_path, 6)


def test_the_interrupted_message_without_a_checkpoint_says_to_start_over(tmp_path):
    msg = _interrupted(tmp_path, 2)
    assert msg.startswith("interrupted (SIGTERM) at step 2; no checkpoint was written yet") and "--overwrite" in msg


def test_a_resume_into_a_missing_directory_makes_nothing(tmp_path):
    """With the lock taken before the checks, --resume into a mistyped runner.output_dir made that directory (holding
    only the lock file) before saying there was nothing to resume."""
    missing = tmp_path / "typo"
    with pytest.raises(ckpt.CheckpointError, match=r"--resume: runner.output_dir .*typo does not exist, so there is "
                                                   r"no run to continue"):
        with ckpt.lock_output_dir(missing, run=True, resume=True):
            pass
    assert not missing.exists()


def test_the_progress_bar_shows_the_fields_a_step_has():
    """The bar read rec['reward/mean'] after every step: with progress on (the CLI's default) a run whose algorithm
    logs no reward/mean died with KeyError at step 0 (the closing line's fix did not reach it)."""
    from pipelines.runner import _bar_fields

    assert _bar_fields({"step": 0, "reward/mean": 0.5, "perf/tokens_per_s": 12.3}) == {"reward": "0.500",
                                                                                       "tok_s": "12"}
    assert _bar_fields({"step": 0, "perf/tokens_per_s": 12.3}) == {"tok_s": "12"}


def test_overwrite_does_not_clear_a_tensorboard_directory_reached_through_a_symlink(tmp_path):
    """--overwrite removed the event files of the directory a tensorboard/ symlink names (one shared by other runs)."""
    shared = tmp_path / "shared_tb"
    shared.mkdir()
    other = shared / "events.out.tfevents.1700000000.other.1.0"
    other.write_bytes(b"another run's events")
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").symlink_to(shared, target_is_directory=True)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    assert ckpt.prepare_output_dir(out, resume=False, overwrite=True) is None
    assert other.exists() and (out / "tensorboard").is_symlink()
