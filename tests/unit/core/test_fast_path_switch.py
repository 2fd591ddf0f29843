"""``ORCHESTRA_FAST_PATH`` / ``ORCHESTRA_FAST_PATH_AFTER`` mean what they say or are refused: ``false``, ``off`` and
``no`` left the fast path on (only ``0`` turned it off), and a count below 1 was read as 1."""

from __future__ import annotations

import pytest

from orchestra import _channel


@pytest.mark.parametrize("value", ["0", "false", "False", "off", "no", " OFF "])
def test_the_usual_spellings_of_off_turn_the_fast_path_off(monkeypatch, value):
    monkeypatch.setenv("ORCHESTRA_FAST_PATH", value)
    assert _channel.enabled() is False


@pytest.mark.parametrize("value", ["1", "true", "on", "yes", ""])
def test_the_usual_spellings_of_on_leave_it_on(monkeypatch, value):
    monkeypatch.setenv("ORCHESTRA_FAST_PATH", value)
    assert _channel.enabled() is True


def test_anything_else_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("ORCHESTRA_FAST_PATH", "disabled")
    with pytest.raises(ValueError, match=r"ORCHESTRA_FAST_PATH='disabled'.*0 .*1"):
        _channel.enabled()


@pytest.mark.parametrize("value", ["0", "-3", "2.5", "many"])
def test_a_call_count_below_one_or_not_whole_is_refused(monkeypatch, value):
    monkeypatch.setenv("ORCHESTRA_FAST_PATH_AFTER", value)
    with pytest.raises(ValueError, match="ORCHESTRA_FAST_PATH_AFTER"):
        _channel.threshold()


def test_a_rank_death_seen_on_its_socket_names_the_rank():
    """The fast path learns of a death from the rank's socket, often before supervision does; that error's message
    named no rank ("the worker process died while running this call (RankDied)")."""
    import orchestra as orc
    from orchestra import _backend
    from orchestra._invocation import convert_error

    err = convert_error(_backend.RankDied("rank 1's fast-path socket closed with 1 call(s) unanswered"), "g", "step", 1)
    assert isinstance(err, orc.WorkerDiedError) and (err.group, err.rank, err.endpoint) == ("g", 1, "step")
    assert "rank 1 died" in str(err) and "socket closed" in str(err), str(err)
