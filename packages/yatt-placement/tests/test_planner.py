"""The pure switch planner on hand-built snapshots: no roles, no torch, no device.

Expected decisions come from the rule as written in yatt.placement._plan's module doc:
offload="always" (need unknown) sleeps every awake role the phase does not name; "auto" sleeps
a role only while the phase would not fit beside it (roles the next phase does not need first,
then the largest); a moved memory share forces a sleep; wakes go weights before kv_cache.
"""

NUM_GPUS = 0

import ast
from pathlib import Path

import pytest

from yatt.placement._planner import SwitchDecision, SwitchSnapshot, plan_switch

TAGGED = ("weights", "kv_cache")
WHOLE = ("*",)


def _snapshot(**overrides) -> SwitchSnapshot:
    """Full colocation's train phase: engine and judge awake (whole), trainer asleep."""
    fields = {
        "phase": "train",
        "tags": {"rollout": TAGGED, "genrm": TAGGED, "train": WHOLE},
        "awake": {"rollout": set(TAGGED), "genrm": set(TAGGED), "train": set()},
        "wanted": {"train": {"*"}},
    }
    return SwitchSnapshot(**(fields | overrides))


def _run_switch(snapshot: SwitchSnapshot) -> tuple[list[str], SwitchDecision]:
    """Ask, sleep, ask again on a fake device where a sleep frees exactly the role's bytes."""
    slept: list[str] = []
    while True:
        decision = plan_switch(snapshot)
        if not decision.sleep:
            return slept, decision
        slept += decision.sleep
        awake = {r: set() if r in decision.sleep else t for r, t in snapshot.awake.items()}
        freed = sum(snapshot.role_bytes.get(r, 0) for r in decision.sleep)
        snapshot = SwitchSnapshot(
            **(
                vars(snapshot)
                | {"awake": awake, "free_bytes": (snapshot.free_bytes or 0) + freed, "moved": ()}
            )
        )


def test_need_unknown_sleeps_every_other_awake_role_at_once_and_wakes_the_phase():
    decision = plan_switch(_snapshot())
    assert decision.sleep == ("rollout", "genrm")
    assert decision.kept == ()
    # A role without memory tags wakes whole, in the first stage.
    assert decision.wake == ((("train", ("*",)),), (), ())


def test_auto_keeps_every_role_when_the_phase_fits_beside_them():
    snapshot = _snapshot(
        need_bytes=500, free_bytes=500, role_bytes={"rollout": 3000, "genrm": 2000}
    )
    decision = plan_switch(snapshot)
    assert decision.sleep == ()
    assert decision.kept == ("rollout", "genrm")
    assert not decision.is_short


def test_auto_sleeps_the_largest_only_until_the_phase_fits():
    # need 2500, free 1000: sleeping the 3000-byte engine frees enough; the judge stays.
    snapshot = _snapshot(
        need_bytes=2500, free_bytes=1000, role_bytes={"rollout": 3000, "genrm": 2000}
    )
    assert plan_switch(snapshot).sleep == ("rollout",)  # one at a time
    slept, final = _run_switch(snapshot)
    assert slept == ["rollout"]
    assert final.kept == ("genrm",)
    assert (final.need_bytes, final.free_bytes) == (2500, 4000)


def test_auto_sleeps_roles_the_next_phase_does_not_need_first():
    # The phase after train (sync) needs the engine: the smaller judge sleeps first, and that
    # is enough (1000 + 2000 >= 2500).
    snapshot = _snapshot(
        need_bytes=2500,
        free_bytes=1000,
        role_bytes={"rollout": 3000, "genrm": 2000},
        needed_next={"rollout", "train"},
    )
    slept, final = _run_switch(snapshot)
    assert slept == ["genrm"]
    assert final.kept == ("rollout",)


def test_auto_sleeps_all_and_reports_short_when_even_that_does_not_fit():
    snapshot = _snapshot(need_bytes=9000, free_bytes=1000, role_bytes={"rollout": 3, "genrm": 2})
    slept, final = _run_switch(snapshot)
    assert slept == ["rollout", "genrm"]
    assert final.kept == ()
    assert final.is_short


def test_a_moved_share_sleeps_first_even_when_the_phase_fits():
    snapshot = _snapshot(
        need_bytes=10, free_bytes=10_000, role_bytes={"rollout": 3, "genrm": 2}, moved={"genrm"}
    )
    decision = plan_switch(snapshot)
    assert decision.sleep == ("genrm",)
    slept, final = _run_switch(snapshot)
    assert slept == ["genrm"]
    assert final.kept == ("rollout",)


def test_wakes_weights_of_every_role_before_any_kv_cache():
    snapshot = _snapshot(
        phase="rollout",
        awake={"rollout": set(), "genrm": set(), "train": {"*"}},
        wanted={"rollout": set(TAGGED), "genrm": set(TAGGED)},
    )
    decision = plan_switch(snapshot)
    assert decision.sleep == ("train",)
    assert decision.wake == (
        (("rollout", ("weights",)), ("genrm", ("weights",))),
        (("rollout", ("kv_cache",)), ("genrm", ("kv_cache",))),
        (),
    )


def test_tags_outside_the_stages_wake_last_and_awake_tags_do_not_wake_again():
    snapshot = _snapshot(
        phase="rollout",
        tags={"rollout": ("weights", "kv_cache", "lora"), "genrm": TAGGED, "train": WHOLE},
        awake={"rollout": {"weights"}, "genrm": set(), "train": set()},
        wanted={"rollout": {"weights", "kv_cache", "lora"}},
    )
    decision = plan_switch(snapshot)
    assert decision.wake == ((), (("rollout", ("kv_cache",)),), (("rollout", ("lora",)),))


def test_a_role_awake_with_more_tags_than_asked_neither_sleeps_nor_wakes():
    # The sync phase asks the engine for its weights only; its KV cache stays awake.
    snapshot = _snapshot(
        phase="sync",
        awake={"rollout": set(TAGGED), "genrm": set(), "train": {"*"}},
        wanted={"train": {"*"}, "rollout": {"weights"}},
    )
    decision = plan_switch(snapshot)
    assert decision.sleep == ()
    assert decision.wake == ((), (), ())


def test_known_need_without_a_free_reading_is_refused():
    with pytest.raises(ValueError, match="free_bytes"):
        plan_switch(_snapshot(need_bytes=10))


def test_the_planner_imports_only_the_standard_library():
    # Pure: a snapshot in, a decision out; no torch, no roles, no sibling module's state.
    import yatt.placement._planner as planner

    tree = ast.parse(Path(planner.__file__).read_text())
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported == {"__future__", "collections.abc", "dataclasses"}
