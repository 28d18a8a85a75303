"""The load-aware planner: speculate where a pass's cost is flat in its positions, batch where it is linear."""

from __future__ import annotations

import pytest

from exactspec.costs import MeasuredPassCosts as PassCost
from exactspec.server.speculation import SpeculationPlanner

FLAT = PassCost({1: 1.0, 1024: 1.0})  # weight streaming dominates: more positions are free
LINEAR = PassCost({1: 1.0, 1024: 1024.0})  # arithmetic dominates: every position costs the same


def test_pass_cost_interpolates_extrapolates_and_learns_a_scale_not_a_shape():
    cost = PassCost({1: 1.0, 5: 2.0, 9: 4.0})
    assert cost(3) == pytest.approx(1.5) and cost(7) == pytest.approx(3.0)
    assert cost(13) == pytest.approx(6.0)  # past the last point, along the last segment
    for _ in range(60):  # passes over 9 positions take twice what was measured
        cost.observe(9, 8.0)
    assert cost(9) == pytest.approx(8.0, rel=0.01)
    assert cost(3) / cost(9) == pytest.approx(1.5 / 4.0)  # the shape is kept


def test_always_scores_every_draft_token_and_never_none():
    assert SpeculationPlanner("always").draft_lengths([4, 0, 2], [0.1, 0.5, 0.9]) == [4, 0, 2]
    assert SpeculationPlanner("never").draft_lengths([4, 0, 2], [0.9, 0.9, 0.9]) == [0, 0, 0]


def test_auto_speculates_fully_where_extra_positions_are_free():
    assert SpeculationPlanner("auto", FLAT).draft_lengths([4, 3], [0.3, 0.6]) == [4, 3]


def test_auto_decodes_plainly_where_every_position_costs_a_token():
    # a draft token earns a^j < 1 expected tokens and costs as much as a plain token: never worth it
    assert SpeculationPlanner("auto", LINEAR).draft_lengths([4] * 8, [0.9] * 8) == [0] * 8


def test_auto_goes_further_for_requests_whose_drafts_are_accepted():
    # cost rises gently: 1 + 0.1 per position past the batch's own
    gentle = PassCost({1: 1.0, 2: 1.1, 1000: 100.9})
    lengths = SpeculationPlanner("auto", gentle).draft_lengths([8, 8], [0.95, 0.3])
    assert lengths[0] > lengths[1] >= 0 and lengths[0] >= 4


def test_auto_speculates_for_few_requests_and_stops_for_many():
    # flat up to 8 positions, then linear: the shape measured on a CPU (docs/benchmarks.md)
    knee = PassCost({1: 1.0, 8: 1.0, 1024: 128.0})
    planner = SpeculationPlanner("auto", knee)
    assert sum(planner.draft_lengths([4], [0.6])) == 4
    assert sum(planner.draft_lengths([4] * 32, [0.6] * 32)) == 0


def test_each_request_may_ask_for_its_own_mode_beside_the_others():
    """always: all it was offered, never: none, whatever the load; the auto ones are planned around them."""
    knee = PassCost({1: 1.0, 8: 1.0, 1024: 128.0})
    planner = SpeculationPlanner("auto", knee)
    assert planner.draft_lengths([4, 4, 4], [0.6] * 3, ["always", "never", "auto"]) == [4, 0, 1]
    # the always request's 4 positions fill the free ones: the auto request is offered none of them
    assert planner.draft_lengths([4, 4, 4, 4], [0.6] * 4, ["always", "auto", "never", "never"]) == [4, 0, 0, 0]
    crowded = planner.draft_lengths([4] * 32, [0.6] * 32, ["always"] + ["auto"] * 31)
    assert crowded == [4] + [0] * 31  # under load only the request that insists drafts
    assert SpeculationPlanner("auto", FLAT).draft_lengths([3, 3], [0.5, 0.5], ["never", "auto"]) == [0, 3]


def test_a_request_may_ask_for_never_anywhere_always_where_the_server_drafts_and_auto_where_it_plans():
    assert SpeculationPlanner("never").modes == ("never",)
    assert SpeculationPlanner("always").modes == ("always", "never")
    assert SpeculationPlanner("auto", FLAT).modes == ("auto", "always", "never")
