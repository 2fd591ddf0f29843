"""The runner always shuts its cluster down, and an error while saving the trace never hides the run's error."""

import logging

import pytest

import pipelines.runner as runner_mod
from pipelines.config import load_config
from pipelines.runner import Runner


class FakeCluster:
    def __init__(self) -> None:
        self.shut = 0

    async def ready(self) -> None:
        return None

    def groups(self) -> list:
        return []

    def shutdown(self) -> None:
        self.shut += 1


class FakeTracer:
    def __init__(self, *groups, start_error=None) -> None:
        self.start_error = start_error

    async def start(self) -> None:
        if self.start_error is not None:
            raise self.start_error

    async def collect(self) -> None:
        raise OSError("collect failed")

    def save(self, path) -> None:
        raise AssertionError("not reached")


@pytest.fixture
def runner(tmp_path, monkeypatch):
    cluster = FakeCluster()
    monkeypatch.setattr(runner_mod.orc, "init", lambda *a, **k: None)
    monkeypatch.setattr(runner_mod, "build_cluster", lambda cfg, task: cluster)
    cfg = load_config(None, [f"runner.output_dir={tmp_path}", "runner.trace=true"])
    return Runner(cfg, progress=False), cluster


async def test_trace_error_does_not_hide_the_run_error_and_the_cluster_goes_down(runner, monkeypatch, caplog):
    r, cluster = runner
    monkeypatch.setattr(runner_mod.orc, "Tracer", lambda *g: FakeTracer(start_error=RuntimeError("the run's error")))
    with caplog.at_level(logging.ERROR, logger="orchestra"), pytest.raises(RuntimeError, match="the run's error"):
        await r.run()
    assert cluster.shut == 1
    assert any("saving the trace failed" in rec.message and rec.exc_info and "collect failed" in str(rec.exc_info[1])
               for rec in caplog.records)


async def test_trace_error_of_a_successful_run_is_raised_after_shutdown(runner):
    r, cluster = runner
    r.tracer = FakeTracer()
    r.cluster = cluster
    with pytest.raises(OSError, match="collect failed"):
        await r._close(failed=False)
    assert cluster.shut == 1
