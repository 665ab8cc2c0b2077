"""The agents' departure from host 0's rendezvous store, on real TCPStores in one process:
the store's host keeps it until every other agent is done with it, and not forever.

The end to end case (a second agent that shuts the rendezvous down late) is in
tests/integration/test_agent.py.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from dtrain.runtime.agent.workers import depart
from torch.distributed import TCPStore


@pytest.fixture
def stores():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=10))
    clients = [TCPStore("127.0.0.1", server.port, is_master=False,
                        timeout=timedelta(seconds=10)) for _ in range(2)]
    yield server, clients


def test_the_host_keeps_its_store_until_every_other_agent_departed(stores):
    server, clients = stores
    returned = threading.Event()
    waiting = threading.Thread(target=lambda: (
        depart(server, holds_store=True, agents=3), returned.set()))
    waiting.start()
    assert depart(clients[0], holds_store=False, agents=3)
    time.sleep(0.5)
    assert not returned.is_set(), "the host left with one agent still using its store"
    assert depart(clients[1], holds_store=False, agents=3)
    assert returned.wait(5)
    waiting.join()


def test_the_host_gives_up_on_an_agent_that_never_departs(stores):
    server, clients = stores
    depart(clients[0], holds_store=False, agents=3)
    started = time.monotonic()
    assert depart(server, holds_store=True, agents=3, wait_s=0.5) is False
    assert 0.5 <= time.monotonic() - started < 3


def test_a_single_host_does_not_wait(stores):
    server, _ = stores
    started = time.monotonic()
    assert depart(server, holds_store=True, agents=1)
    assert time.monotonic() - started < 0.5
