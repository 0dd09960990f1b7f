"""Weight sync from an offloaded trainer on a GPU (skipped on CPU machines): its empty device
placeholders are refused with the fix, its pinned host copies stream into the engine."""

NUM_GPUS = 1

import pytest
import torch

from yatt.placement import is_offload_placeholder, offload, offloaded_named_parameters, onload
from yatt.rollout import BuiltinEngine, EngineConfig
from yatt.rollout._weights import named_targets
from yatt.testing import make_tiny_causal_lm

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_offloaded_trainer_syncs_from_pinned_host_copies(tiny_model_dir):
    config = EngineConfig(
        device="cuda", max_batch_size=4, max_seq_len=128, region_prefix="offload-sync"
    )
    engine = BuiltinEngine(tiny_model_dir, config=config)
    try:
        trainer = make_tiny_causal_lm(arch="qwen2", seed=1, max_position_embeddings=512).cuda()
        want = {name: p.detach().clone() for name, p in trainer.named_parameters()}
        served = named_targets(engine.model)
        assert any(not torch.equal(served[n], w.to(served[n].dtype)) for n, w in want.items())

        offload(trainer)
        # On CUDA offload leaves empty placeholders on the device (grad hooks survive).
        assert all(p.is_cuda and is_offload_placeholder(p) for p in trainer.parameters())
        with pytest.raises(
            ValueError,
            match=r"'model\.embed_tokens\.weight' with shape \(0,\).*offloaded_named_parameters",
        ):
            engine.update_weights(trainer.named_parameters())

        hosts = list(offloaded_named_parameters(trainer))
        assert [name for name, _ in hosts] == list(want)
        assert all(t.device.type == "cpu" and t.is_pinned() for _, t in hosts)
        engine.update_weights(iter(hosts), bucket_bytes=1 << 16)  # pinned host -> GPU, in parts
        served = named_targets(engine.model)
        for name, value in want.items():
            assert served[name].is_cuda
            assert torch.equal(served[name], value.to(served[name].dtype)), name
        del hosts  # the host copies are offload's: onload frees them

        onload(trainer)
        for name, param in trainer.named_parameters():
            assert param.is_cuda and torch.equal(param, want[name]), name
    finally:
        engine.close()
