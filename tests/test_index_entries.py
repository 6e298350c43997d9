"""Where a prefix state is published in the index (`index_entries`), and when one in flight
is ready (`prefix_ready_at`): one rule each, which the replica's publisher, the router's
ledger and the simulator all call."""

from __future__ import annotations

import pytest

from baton_serve.cache_store.index import index_entries as rule
from baton_serve.loadtests import sim_policies, sim_replica
from baton_serve.replicas import index_publisher
from baton_serve.router.routing import routing_ledger

CHAIN = [bytes([i]) * 16 for i in range(4)]


def test_an_attention_state_is_found_under_every_whole_block_it_covers() -> None:
    entries = rule.index_entries(CHAIN, 70, 16, every_block=True)
    assert entries == [(CHAIN[0], 16), (CHAIN[1], 32), (CHAIN[2], 48), (CHAIN[3], 70)]


def test_a_hybrid_state_is_found_only_under_its_last_whole_block_with_its_length() -> None:
    assert rule.index_entries(CHAIN, 40, 16, every_block=False) == [(CHAIN[1], 40)]


def test_a_state_shorter_than_a_block_is_not_published() -> None:
    assert rule.index_entries(CHAIN, 15, 16, every_block=True) == []
    assert rule.index_entries((), 15, 16, every_block=False) == []


def test_a_chain_too_short_for_the_state_is_an_error() -> None:
    with pytest.raises(ValueError, match="2 blocks cannot place 48 tokens"):
        rule.index_entries(CHAIN[:2], 48, 16, every_block=False)


def test_a_prefix_in_flight_is_ready_as_the_prefill_passes_it() -> None:
    # 1,000 tokens at 100 a second, from token 200 (cached), ending at t=108
    assert rule.prefix_ready_at(108.0, 1000, 700, 100.0, computed_from=200) == 105.0
    assert rule.prefix_ready_at(108.0, 1000, 1000, 100.0) == 108.0
    # a position within what is cached: when the prefill starts
    assert rule.prefix_ready_at(108.0, 1000, 100, 100.0, computed_from=200) == 100.0
    assert rule.prefix_ready_at(108.0, 1000, 700, 0.0) == 108.0  # no speed known: the end


def test_the_publisher_the_ledger_and_the_simulator_call_the_one_rule() -> None:
    callers = (index_publisher, routing_ledger, sim_replica, sim_policies)
    assert all(module.index_entries is rule.index_entries for module in callers)
    ready_callers = (index_publisher, routing_ledger, sim_replica)
    assert all(module.prefix_ready_at is rule.prefix_ready_at for module in ready_callers)
