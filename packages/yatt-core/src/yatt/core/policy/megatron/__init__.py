"""The Megatron-Core policy backend (`pip install yatt-core[megatron]`); its public path is
`yatt.core.megatron`, which exports its names.

Importing this package needs no megatron-core: the config translation and the HF <-> Megatron
weight mapping are plain torch. `MegatronPolicy` imports megatron-core when it is built.
"""

__all__: list[str] = []  # a family folder: the names are yatt.core.megatron's
