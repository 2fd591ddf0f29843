"""A Worker for the multi-node tests; shipped to the nodes as the ``working_dir`` of the job's runtime_env."""

from __future__ import annotations

from orchestra import Worker, endpoint
from orchestra import dispatch as D


class Where(Worker):
    """Says which rank it is (placement is what these tests look at)."""

    @endpoint(D.broadcast())
    def rank_of(self) -> int:
        return self.rank
