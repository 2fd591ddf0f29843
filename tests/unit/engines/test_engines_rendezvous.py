"""The default process group an engine joins listens only where ``MASTER_ADDR`` says: torch's ``tcp://``
rendezvous starts its key-value store (which hands every rank its peers' addresses, with no authentication) on every
interface of rank 0's machine, whatever the address; a local job on 127.0.0.1 was reachable from the network. And
gloo (which listens where the machine's hostname resolves to) or NCCL's bootstrap (on a non-loopback interface) is
put on the loopback interface for such a job."""

from __future__ import annotations

import os

import pytest
from engines_testutils import listening_addresses_worker, plain_bind_refused_worker

import engines._dist as dist_mod
from engines._dist import spawn

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow  # forks 2 gloo ranks
def test_a_local_group_listens_on_loopback_only():
    per_rank = spawn(listening_addresses_worker, 2)  # spawn sets MASTER_ADDR=127.0.0.1
    assert [r["sum"] for r in per_rank] == [2.0, 2.0]  # the group works
    for rank, r in enumerate(per_rank):
        assert r["listening"], f"rank {rank} listens nowhere: the probe saw none of its sockets"
        assert set(r["listening"]) <= {"127.0.0.1", "::1"}, f"rank {rank} listens on {r['listening']}"
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        assert [r["gloo_ifname"] for r in per_rank] == [dist_mod._loopback_interface()] * 2


@pytest.mark.parametrize("variable", ["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"])
def test_the_backend_is_put_on_loopback_only_for_a_loopback_master_and_never_over_the_users_choice(monkeypatch,
                                                                                                 variable):
    lo = dist_mod._loopback_interface()
    assert lo is not None  # Linux: the interface flagged IFF_LOOPBACK
    for addr, expected in [("127.0.0.1", lo), ("localhost", lo), ("192.0.2.7", None)]:
        monkeypatch.delenv(variable, raising=False)
        dist_mod._sockets_on_loopback_for(addr, variable)
        assert os.environ.get(variable) == expected, addr
    monkeypatch.setenv(variable, "eth7")
    dist_mod._sockets_on_loopback_for("127.0.0.1", variable)
    assert os.environ[variable] == "eth7"


@pytest.mark.slow  # forks 2 gloo ranks, twice
def test_spawn_starts_again_on_another_port_when_its_port_was_taken_before_rank_0_listened(monkeypatch, caplog):
    """Should the port ``spawn`` holds for rank 0's store be taken anyway (another process listening on it with
    SO_REUSEADDR), rank 0 fails with EADDRINUSE before anything ran, and the ranks start again on another port.
    (Before, the spawn failed; the test makes it certain by handing out a port that is taken.)"""
    import logging
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]

        class Taken:  # what a hold of a port someone took meanwhile would look like
            def getsockname(self):
                return ("127.0.0.1", port)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return None

        holds = iter([Taken()])
        real = dist_mod._hold_port
        monkeypatch.setattr(dist_mod, "_hold_port", lambda: next(holds, None) or real())
        caplog.set_level(logging.WARNING, logger="orchestra")
        per_rank = spawn(listening_addresses_worker, 2)
    assert [r["sum"] for r in per_rank] == [2.0, 2.0]
    assert f"spawn: port {port} was taken by another process before rank 0 listened on it" in caplog.text


def test_under_torchruns_agent_every_rank_is_a_client_of_the_agents_store(monkeypatch):
    """torchrun's agent serves the store on MASTER_PORT itself (``TORCHELASTIC_USE_AGENT_STORE=True``): rank 0 joins
    it as a client, as torch's own rendezvous does, instead of failing to bind a port the agent holds."""
    import datetime
    import socket

    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agent = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    rank0 = dist_mod.rendezvous_store("127.0.0.1", port, 0, 2)
    rank0.set("from_rank_0", "1")
    assert agent.get("from_rank_0") == b"1"


@pytest.mark.parametrize("addr, pinned", [("127.0.0.1", True), ("::1", True), ("10.1.2.3", True), ("localhost", True),
                                          ("vm", False), ("head-node.cluster.internal", False)])
def test_only_an_address_every_machine_reads_alike_is_listened_on_alone(addr, pinned):
    """An IP literal or ``localhost`` is served on that address only; another hostname can resolve here to another
    address than on the other nodes (Debian maps this machine's own name to 127.0.1.1), so it keeps torch's every
    interface, and no loopback interface is forced on gloo or NCCL for it."""
    assert dist_mod._pinned_address(addr) is pinned


@pytest.mark.slow  # forks a rank
def test_spawn_holds_its_port_until_the_ranks_end():
    """The port a spawn's ranks get is held bound by the caller (SO_REUSEADDR, not listening) until they end: no
    other process can bind it, or get it for an outgoing connection, before rank 0's store listens on it. Before, it
    was picked free and released, and anything could take it in between."""
    (refused,) = spawn(plain_bind_refused_worker, 1)
    assert refused, "another process could bind the port the ranks were given"
