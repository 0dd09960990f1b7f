"""The cost model: a sample's relative compute (and a layout's memory) from a model's shape.

    _cost_model          flops_shape, estimate_flops_costs, estimate_megatron_memory
    _activation_memory   a train step's activation bytes, the micro-batch cap a budget fits
    _policy_memory       a torch policy's memory model: the cap from free memory, its peak,
                         the settings that lower each part, the optimizer state on the host

It imports no other family, so every policy backend (torch, megatron) and the vision tower's
cost can build on it without an import running back up.
"""

__all__: list[str] = []  # a family folder: its public names are yatt.core's
