"""The RL math family: from rollout completions and rewards to the loss the policy minimises.

    _rollout_samples     completions -> training samples (the one place a trainer does it)
    _advantages          group-relative advantages, the zero-variance filter
    _sampler, _sampling  DAPO dynamic sampling (the object the loop drives; its callback form)
    _partial_rollouts    aborted responses kept to be finished next step
    _overlong            DAPO's overlong penalty and filter
    _rollout_correction  importance weights of the trainer's old policy against the engine's
    _surrogates          per-token policy-gradient terms: PPO's clip, GSPO, CISPO
    _losses              PolicyLoss: the objective, KL, entropy, aggregation
    _staleness           off-policy steps: StalenessConfig, check_staleness, AdmissionControl
    _in_flight           prompts started and not yet trained, checkpointed with their versions
    _async_rollout       AsyncRollout: generation running ahead of training (threads)
    _turn_versions       VersionRecordingEngine: a multi-turn trajectory's version per token
    _offpolicy_metrics   tokens and importance weights by age (compute_staleness_metrics)

It imports the data, runtime and vision families; no policy backend.
"""

__all__: list[str] = []  # a family folder: its public names are yatt.core's
