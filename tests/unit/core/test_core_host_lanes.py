"""The worker's two lanes share counters and trace events: the control lane reads consistent snapshots while the
compute lane writes, and no event is lost between a take and the next add (Ray-free: threads as in a worker)."""

from __future__ import annotations

import threading

from orchestra._host import _Events, _Stats


def test_stats_snapshot_while_the_compute_lane_adds_endpoints():
    stats = _Stats()
    errors: list[BaseException] = []
    stop = threading.Event()

    def compute() -> None:
        for i in range(20_000):
            stats.begin(f"role{i % 3}", f"ep{i}")  # a call begun: counted, under the lock
        stop.set()

    def control() -> None:
        try:
            while not stop.is_set():
                stats.snapshot()
                stats.snapshot("role1")
        except BaseException as e:  # noqa: BLE001 - the assertion below reports it
            errors.append(e)

    threads = [threading.Thread(target=compute), threading.Thread(target=control)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    snap = stats.snapshot()
    assert len(snap) == 20_000 and all(c["calls"] == 1 for c in snap.values())


def test_no_trace_event_is_lost_between_takes():
    events = _Events()
    taken: list[dict] = []
    done = threading.Event()

    def compute() -> None:
        for i in range(50_000):
            events.add({"i": i})
        done.set()

    def control() -> None:
        while not done.is_set():
            taken.extend(events.take())
        taken.extend(events.take())

    threads = [threading.Thread(target=compute), threading.Thread(target=control)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [e["i"] for e in taken] == list(range(50_000))


def test_reset_starts_counting_again():
    stats = _Stats()
    stats.begin("r", "a")
    stats.begin("r", "a")
    stats.reset()
    assert stats.snapshot() == {}
    stats.begin("r", "a")
    assert stats.snapshot("r")["a"]["calls"] == 1
