"""The runtime family: what every other family may use, and which uses none of them.

    _runtime         rank, device, process groups, the (dp, tp) mesh; seeding
    _metrics         scalar statistics reduced across ranks in one collective
    _repeated_log    a warning that can fire every step, logged readably
    _run_log         a run's metrics: JSON lines, TensorBoard, Weights & Biases, a plot
    _learning_guard  stop a run whose steps update nothing

Public names are re-exported by `yatt.core`; import them from there.
"""

__all__: list[str] = []  # a family folder: its public names are yatt.core's
