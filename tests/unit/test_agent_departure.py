"""The agents' departure from host 0's rendezvous store, on real TCPStores in one process:
the store's host keeps it until every other agent is done with it, and not forever; only after
a success, while the other agents always say they are done.

The end to end case (a second agent that shuts the rendezvous down late) is in
tests/integration/test_agent.py.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from dtrain.runtime.agent import workers
from dtrain.runtime.agent.workers import DEPARTED_KEY, InterruptionAwareAgent, depart
from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server.api import WorkerState


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
        depart(server, holds_store=True, agents=3, wait_s=10), returned.set()))
    waiting.start()
    assert depart(clients[0], holds_store=False, agents=3, wait_s=10)
    time.sleep(0.5)
    assert not returned.is_set(), "the host left with one agent still using its store"
    assert depart(clients[1], holds_store=False, agents=3, wait_s=10)
    assert returned.wait(5)
    waiting.join()


def test_the_host_gives_up_on_an_agent_that_never_departs(stores):
    server, clients = stores
    depart(clients[0], holds_store=False, agents=3, wait_s=10)
    started = time.monotonic()
    assert depart(server, holds_store=True, agents=3, wait_s=0.5) is False
    assert 0.5 <= time.monotonic() - started < 3


def test_a_single_host_does_not_wait(stores):
    server, _ = stores
    started = time.monotonic()
    assert depart(server, holds_store=True, agents=1, wait_s=10)
    assert time.monotonic() - started < 0.5


class _Group:
    """What rendezvous_shut_down reads of torch's WorkerGroup."""

    def __init__(self, store, agents: int, state: WorkerState):
        self.store, self.group_world_size, self.state = store, agents, state


def _agent(store, *, holds_store: bool, succeeded: bool, agents: int = 3):
    # the agent's hook alone, without a launch around it
    agent = InterruptionAwareAgent.__new__(InterruptionAwareAgent)
    agent.holds_store = holds_store
    state = WorkerState.SUCCEEDED if succeeded else WorkerState.FAILED
    agent.get_worker_group = lambda: _Group(store, agents, state)
    return agent


def test_after_a_failure_the_host_leaves_at_once_and_the_others_still_depart(stores):
    server, clients = stores
    started = time.monotonic()
    _agent(server, holds_store=True, succeeded=False).rendezvous_shut_down()
    assert time.monotonic() - started < 0.5, "the host waited for agents after a failure"
    _agent(clients[0], holds_store=False, succeeded=False).rendezvous_shut_down()
    assert server.add(DEPARTED_KEY, 0) == 1


def test_after_a_success_the_host_waits_for_the_others(stores, monkeypatch):
    server, clients = stores
    monkeypatch.setattr(workers, "DEPARTURE_WAIT_S", 0.5)
    _agent(clients[0], holds_store=False, succeeded=True).rendezvous_shut_down()
    started = time.monotonic()
    _agent(server, holds_store=True, succeeded=True).rendezvous_shut_down()  # one never departs
    assert time.monotonic() - started >= 0.5
