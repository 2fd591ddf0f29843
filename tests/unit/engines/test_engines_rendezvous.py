"""The default process group an engine joins listens only where ``MASTER_ADDR`` says: torch's ``tcp://``
rendezvous starts its key-value store (which hands every rank its peers' addresses, with no authentication) on every
interface of rank 0's machine, whatever the address; a local job on 127.0.0.1 was reachable from the network. And
gloo (which listens where the machine's hostname resolves to) or NCCL's bootstrap (on a non-loopback interface) is
put on the loopback interface for such a job."""

from __future__ import annotations

import os

import pytest
from engines_testutils import listening_addresses_worker

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
