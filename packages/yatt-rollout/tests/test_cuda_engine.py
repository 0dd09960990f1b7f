"""The conformance suite and CUDA-graph decoding on a GPU (skipped on CPU machines)."""

NUM_GPUS = 1

import pytest
import torch
from transformers import AutoModelForCausalLM

from yatt.rollout import BuiltinEngine, EngineConfig, Request, SamplingParams
from yatt.rollout.testing import CONFORMANCE_CHECKS, ConformanceTarget
from yatt.testing import make_tiny_causal_lm

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def cuda_target(tiny_model_dir):
    config = EngineConfig(device="cuda", max_batch_size=4, max_seq_len=256, region_prefix="cuda")
    engine = BuiltinEngine(tiny_model_dir, config=config)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval().cuda()
    original = {n: t.clone() for n, t in reference.state_dict().items()}
    other = make_tiny_causal_lm(arch="qwen2", seed=1, max_position_embeddings=512).cuda()

    def reference_logprobs(prompt, response, temperature):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + response], device="cuda")).logits[0].float()
        logits = logits[len(prompt) - 1 : -1] / (temperature if temperature > 0 else 1.0)
        ids = torch.tensor(response, device="cuda")[:, None]
        return torch.log_softmax(logits, -1).gather(-1, ids)[:, 0].tolist()

    yield ConformanceTarget(
        engine=engine,
        vocab_size=reference.config.vocab_size,
        max_seq_len=256,
        new_weights=lambda: other.named_parameters(),
        original_weights=lambda: original.items(),
        reference_logprobs=reference_logprobs,
        logprob_atol=1e-3,  # TF32/kernel differences on GPU
    )
    engine.close()


@pytest.mark.parametrize("name", list(CONFORMANCE_CHECKS))
def test_builtin_engine_conforms_on_cuda(cuda_target, name):
    CONFORMANCE_CHECKS[name](cuda_target)


def test_cuda_graph_matches_eager(tiny_model_dir):
    # 3 + 90 tokens cross the 64-position span bucket: two graphs per engine, switched mid-run.
    requests = [Request(prompt_ids=[5 + i, 6, 7]) for i in range(6)]
    sampling = SamplingParams(n=2, max_new_tokens=90, seed=3, ignore_eos=True)
    outputs = []
    for use_graph in (False, True):
        config = EngineConfig(
            device="cuda", max_batch_size=4, max_seq_len=256, use_cuda_graph=use_graph
        )
        engine = BuiltinEngine(tiny_model_dir, config=config)
        outputs.append(engine.generate(requests, sampling))
        assert engine._runner.use_cuda_graph == use_graph
        engine.close()
    eager, graph = outputs
    assert [c.response_ids for c in graph] == [c.response_ids for c in eager]
    for g, e in zip(graph, eager, strict=True):
        torch.testing.assert_close(
            torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=1e-4, rtol=0
        )


def test_memory_fraction_resizes_the_kv_cache_on_cuda(tiny_model_dir):
    # Sized from the GPU's total memory: the fraction that holds the weights and 2 slots.
    config = EngineConfig(device="cuda", max_batch_size=8, max_seq_len=256, region_prefix="frac")
    engine = BuiltinEngine(tiny_model_dir, config=config)
    requests = [Request(prompt_ids=[5 + i, 6, 7]) for i in range(6)]
    sampling = SamplingParams(n=2, max_new_tokens=90, seed=3, ignore_eos=True)
    eight = engine.generate(requests, sampling)
    layout, total = engine._kv_layout, torch.cuda.mem_get_info()[1]
    share = engine._weight_bytes + layout.fixed_bytes + 2 * layout.slot_bytes
    engine.set_memory_fraction(share / total * 1.0001)
    assert engine.num_slots == 8  # applied at the next allocation
    engine.sleep()
    engine.wake_up(tags=("weights",))
    engine.wake_up(tags=("kv_cache",))
    assert engine.num_slots == 2
    two = engine.generate(requests, sampling)  # graphs recaptured for the new slot count
    assert [c.response_ids for c in two] == [c.response_ids for c in eight]
    engine.set_memory_fraction(1.0)
    assert [c.response_ids for c in engine.generate(requests, sampling)] == [
        c.response_ids for c in eight
    ]
    assert engine.num_slots == 8
    engine.sleep()
    engine.close()


def test_kept_graphs_survive_sleep_and_wake(tiny_model_dir):
    # keep_graphs_asleep: weights and KV cache come back at the same addresses, so the graphs
    # captured before sleep() replay correctly after wake_up(), with no recapture.
    from yatt.placement import is_paused

    config = EngineConfig(
        device="cuda",
        max_batch_size=4,
        max_seq_len=256,
        region_prefix="keep",
        keep_graphs_asleep=True,
    )
    engine = BuiltinEngine(tiny_model_dir, config=config)
    requests = [Request(prompt_ids=[5 + i, 6, 7]) for i in range(6)]
    sampling = SamplingParams(n=2, max_new_tokens=90, seed=3, ignore_eos=True)
    before = engine.generate(requests, sampling)
    graphs = dict(engine._runner._graphs)
    assert len(graphs) >= 2  # 93 tokens cross a span bucket
    engine.sleep()
    assert is_paused("keep/weights") and is_paused("keep/kv_cache")
    engine.wake_up()
    after = engine.generate(requests, sampling)
    assert engine._runner._graphs.keys() == graphs.keys()
    assert all(engine._runner._graphs[k] is g for k, g in graphs.items()), "recaptured"
    assert [c.response_ids for c in after] == [c.response_ids for c in before]
    assert [c.logprobs for c in after] == [c.logprobs for c in before]
    engine.sleep()
    engine.close()
