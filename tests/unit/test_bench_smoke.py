"""``bench.smoke`` covers every benchmark, and tells a benchmark that measured from one that did not."""

from __future__ import annotations

from bench import smoke


def test_every_benchmark_module_has_quick_arguments_or_a_reason_to_skip() -> None:
    assert set(smoke.QUICK) == set(smoke.modules()), "add the new benchmark to bench.smoke.QUICK"
    skipped = {n for n, args in smoke.QUICK.items() if args is None}
    assert skipped == set(smoke.SKIPPED)
    assert all(smoke.SKIPPED[n].strip() for n in skipped)


def test_a_benchmark_that_runs_prints_json_and_one_that_cannot_parse_its_arguments_fails() -> None:
    ran = smoke.run_one("batch_checks", smoke.QUICK["batch_checks"], timeout=300)  # Ray-free, a few seconds
    assert ran["ok"] and ran["rc"] == 0 and ran["printed_json"], ran
    refused = smoke.run_one("batch_checks", ["--no-such-flag"], timeout=300)
    assert refused["ok"] is False and refused["rc"] == 2 and "--no-such-flag" in refused["error"], refused


def test_the_json_is_found_among_ray_log_lines_and_a_log_line_alone_is_not_json() -> None:
    doc = '{\n  "bench": "recovery",\n  "results": {"x": 1}\n}\n'
    log = "\x1b[33m(raylet)\x1b[0m A worker died or was killed {while executing a task}\n"
    assert smoke.printed_a_document(doc)
    assert smoke.printed_a_document(log + doc + log)
    assert not smoke.printed_a_document(log)
    assert not smoke.printed_a_document('{\n  "bench": "cut short",\n')
    assert not smoke.printed_a_document("")
