"""The Megatron optimizer state's layout marker, without megatron-core: a torch Adam stands in
for the optimizer inside Megatron's wrapper (`.optimizer`)."""

NUM_GPUS = 0

import types

import pytest
import torch

from yatt.core.policy.megatron._state import MegatronOptimizerState, layout_key, parse_layout_key

LAYOUT = {"tp_size": 1, "pp_size": 2, "virtual_pp_size": 1, "cp_size": 1, "dp_size": 1}


def _state(layout, *, pp_rank: int = 0) -> MegatronOptimizerState:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
    wrapper = types.SimpleNamespace(optimizer=torch.optim.Adam(params))
    return MegatronOptimizerState(wrapper, tp_rank=0, dp_rank=0, pp_rank=pp_rank, layout=layout)


def test_the_marker_leads_the_state_and_names_the_layout():
    saved = _state(LAYOUT).state_dict()
    first = next(iter(saved))
    assert first == "layout(tp_size=1,pp_size=2,virtual_pp_size=1,cp_size=1,dp_size=1)"
    assert parse_layout_key(first) == LAYOUT
    assert parse_layout_key("tp0.pp0.cp0.dp0.g0.p0.main") is None
    assert layout_key(parse_layout_key(first)) == first


def test_a_state_saved_at_another_pp_size_is_refused_naming_it():
    saved = _state(LAYOUT).state_dict()
    here = {**LAYOUT, "pp_size": 1, "dp_size": 2}
    # Positional keys of equal shapes exist (stage 0's): without the marker they would load.
    with pytest.raises(ValueError, match=r"pp_size=2 saved, 1 now, dp_size=1 saved, 2 now"):
        _state(here).load_state_dict(saved)
    _state(LAYOUT).load_state_dict(saved)  # the same layout loads
