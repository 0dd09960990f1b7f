"""The policy family: the model being trained, behind one protocol, and what it is saved as.

    _policy               PolicyBackend (the protocol the trainer sees), TorchPolicyConfig
    _train_step           the train step and logprobs pass every backend runs (its hooks)
    _torch_policy         TorchPolicy: a Hugging Face model under DDP or FSDP2
    _lora                 LoraConfig: TorchPolicy's LoRA through PEFT (train, save, sync the adapter)
    megatron/             MegatronPolicy: Megatron-Core TP/PP/CP (public as yatt.core.megatron)
    _backends             a backend chosen by name (build_policy)
    _head_logprobs        token logprobs inside the LM head, chunk by chunk
    _logits               token logprobs and entropy from full logits
    _optimization         the learning-rate schedule both backends share
    _export               a policy saved as a Hugging Face folder
    _checkpoint_tensors   a model's full tensors read out of a DCP checkpoint

It imports the data, runtime, cost and vision families; nothing imports it but `yatt.core`.
"""

__all__: list[str] = []  # a family folder: its public names are yatt.core's
