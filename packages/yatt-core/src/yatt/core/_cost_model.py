"""Moved to yatt.core.cost._cost_model. This re-export stands only while the vision modules
(_vision_cost) still import the old path; issue 25's merge points them at cost/ and deletes it."""

from yatt.core.cost._cost_model import estimate_flops_costs, flops_shape

__all__ = ["estimate_flops_costs", "flops_shape"]
