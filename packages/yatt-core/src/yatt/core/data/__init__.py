"""The data family: prompt rows in, batches of samples out, split for the optimizer and the device.

    _sources         random access to JSONL, Parquet and `datasets` rows
    _row_fields      a row's field by name, dotted for a nested one
    _loader          ShardedLoader: each rank reads only its own prompts, resumably
    _prompts         PromptEncoder: rows -> the policy's token ids and images, tokenized once
    _model_paths     a model folder or a Hub id already in the cache
    _batch           Batch: padded tensors + per-sample metadata; cross-rank rebalancing
    _mini_batches    a rollout batch split into optimizer steps of whole groups
    _micro_batches   a policy's batch packed into micro-batches by cost, bounded in size

It imports the vision family (a row's images) and nothing above it.
"""

__all__: list[str] = []  # a family folder: its public names are yatt.core's
