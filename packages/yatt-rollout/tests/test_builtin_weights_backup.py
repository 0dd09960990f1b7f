"""A built-in engine without a weights backup (issue 27: a 7B rollout engine's 15 GB of pinned
host RAM that the trainer's weight sync makes useless): it reports no host need, and refuses to
generate from weights that woke without their contents until update_weights refills them."""

NUM_GPUS = 0

import pytest
import torch
from transformers import AutoModelForCausalLM

from yatt.placement import resident_bytes
from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
PROMPTS = [[5, 9, 13], [7, 3]]


def _requests():
    return [Request(prompt_ids=list(p)) for p in PROMPTS]


def _engine(model_dir, prefix, **kwargs):
    config = EngineConfig(max_batch_size=2, max_seq_len=64, region_prefix=prefix)
    return BuiltinEngine(model_dir, config=config, **kwargs)


def test_only_an_engine_with_a_backup_reports_host_memory(tiny_model_dir):
    backed = _engine(tiny_model_dir, "wb-on")
    bare = _engine(tiny_model_dir, "wb-off", should_back_up_weights=False)
    # The backup is the weights' bytes, as the engine holds them on its device.
    assert backed.host_need().parts == {"weights backup": resident_bytes("wb-on/weights")}
    assert resident_bytes("wb-on/weights") > 0
    # Without: only the buffers (RoPE's inv_freq, outside any weight sync), kept on the host.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    assert 0 < buffer_bytes < resident_bytes("wb-on/weights") / 100
    assert bare.host_need().parts == {"weights backup": buffer_bytes}
    assert "should_back_up_weights=False" in bare.host_need().settings["weights backup"]
    backed.close()
    bare.close()


def test_weights_woken_without_backup_must_be_synced_before_generating(tiny_model_dir):
    engine = _engine(tiny_model_dir, "wb-sync", should_back_up_weights=False)
    before = engine.generate(_requests(), GREEDY)
    engine.sleep()
    engine.wake_up()  # contents undefined (NaN on the CPU backend): not to be decoded from
    with pytest.raises(RuntimeError, match="update_weights"):
        engine.generate(_requests(), GREEDY)
    # The RL order: the trainer's weights sync refills them, then generation runs as before.
    trained = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    engine.update_weights(trained.named_parameters())
    after = engine.generate(_requests(), GREEDY)
    assert [c.response_ids for c in after] == [c.response_ids for c in before]
    engine.close()
