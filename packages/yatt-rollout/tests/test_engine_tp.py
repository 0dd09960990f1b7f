"""Tensor-parallel vLLM and SGLang adapters against fakes of vLLM 0.26.0 and SGLang 0.5.17
(yatt.rollout.testing): two gloo ranks for the collective paths (_engine_tp_worker.py), one
process for the checks that run before anything loads, and the engines' memory reports."""

NUM_GPUS = 0

import json
import sys
from pathlib import Path

import pytest
import torch

from yatt.placement import MemoryNeed
from yatt.rollout import SGLangConfig, SGLangEngine, VLLMConfig, VLLMEngine
from yatt.rollout._engine_memory import CUDA_GRAPH_BYTES_ESTIMATE
from yatt.rollout._engine_tp import check_engine_tp, request_digest
from yatt.rollout._types import Request, SamplingParams
from yatt.rollout.testing import sglang_modules, vllm_modules
from yatt.testing import run_ranks

WORKER = Path(__file__).with_name("_engine_tp_worker.py")
SCENARIOS = ("vllm_tp2", "vllm_tp1", "sglang_tp2", "sglang_tp1")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("engine-tp")
    args = [sys.executable, str(WORKER), "--out", str(out)]
    for name in SCENARIOS:
        args += ["--scenario", name]
    run_ranks(args, 2, timeout_s=180)
    return {
        name: [torch.load(out / f"{name}.{r}.pt", weights_only=False) for r in range(2)]
        for name in SCENARIOS
    }


# -- vLLM: every rank runs its engine under the external launcher ----------------------------


def test_vllm_tp2_builds_one_external_launcher_engine_per_rank(ranks):
    for rank in ranks["vllm_tp2"]:
        kwargs = rank["kwargs"]
        assert kwargs["distributed_executor_backend"] == "external_launcher"
        assert kwargs["tensor_parallel_size"] == 2 and kwargs["seed"] == 0
        assert rank["group"] == (0, 1)


def test_vllm_tp2_ranks_get_identical_results_from_one_agreed_seed(ranks):
    first, second = ranks["vllm_tp2"]
    assert first["generate"] == second["generate"] and first["streamed"] == second["streamed"]
    assert len(first["generate"]) == 4
    # The calls were unseeded: each rank drew its own seed, the engines saw the first rank's.
    assert first["seen_seeds"] == second["seen_seeds"]
    assert all(seed is not None for rid, seed in first["seen_seeds"].items() if "labels" not in rid)
    # Without per-sample seeds, the engines' generators (seeded alike) drew alike.
    assert first["global_draws"] == second["global_draws"] and first["global_draws"]


def test_vllm_tp2_abort_on_one_rank_stops_every_rank_at_the_same_step(ranks):
    first, second = ranks["vllm_tp2"]
    # The fake fails a step whose batch differs between TP ranks; both ended alike, with the
    # tokens of three steps (the abort, asked on rank 1 during the third, ends the loop before
    # a fourth on both ranks).
    assert first["aborted"] == second["aborted"]
    assert [(c[2], c[4]) for c in first["aborted"]] == [([5, 6, 7], "abort")] * 2


def test_vllm_tp2_refuses_a_group_given_different_batches(ranks):
    for rank in ranks["vllm_tp2"]:
        assert "were given different requests" in rank["mismatch_error"]
        assert "ranks [1] differ from rank 0" in rank["mismatch_error"]


def test_vllm_tp2_weight_sync_gives_each_worker_its_slice_of_the_full_tensor(ranks):
    full = {
        "model.layers.0.mlp.up_proj.weight": torch.arange(24.0).reshape(6, 4),
        "model.norm.weight": torch.arange(3.0),
    }
    for tp_rank, rank in enumerate(ranks["vllm_tp2"]):
        weights = rank["worker_weights"]
        # Rows 3r..3r+2 of the 6-row weight; the 3-element norm does not split: whole.
        expected = full["model.layers.0.mlp.up_proj.weight"][3 * tp_rank : 3 * tp_rank + 3]
        torch.testing.assert_close(weights["model.layers.0.mlp.up_proj.weight"], expected)
        torch.testing.assert_close(weights["model.norm.weight"], full["model.norm.weight"])
        # A bucket short on rank 0 only raised on both ranks.
        assert "partly old weights" in rank["short_error"]
        assert "ranks [1] of this engine's TP group loaded other tensors" in rank["names_error"]


def test_vllm_tp1_on_two_ranks_is_one_engine_per_rank_through_the_same_path(ranks):
    for r, rank in enumerate(ranks["vllm_tp1"]):
        assert rank["kwargs"]["distributed_executor_backend"] == "external_launcher"
        assert rank["kwargs"]["tensor_parallel_size"] == 1 and rank["group"] == (r,)
        assert len(rank["generate"]) == 4
        # A group of one checks nothing across ranks: another batch is its own business.
        assert rank["mismatch_error"] is None
        assert "partly old weights" in (rank["short_error"] or "") or r == 1
        assert rank["names_error"] is None  # groups of one: each rank loads its own
    assert ranks["vllm_tp1"][1]["short_error"] is None  # only rank 0's bucket was short


# -- SGLang: one engine on the group's first rank --------------------------------------------


def test_sglang_tp2_runs_one_engine_on_the_first_rank(ranks):
    first, second = ranks["sglang_tp2"]
    assert first["has_engine"] and not second["has_engine"]
    assert first["kwargs"]["tp_size"] == 2 and first["kwargs"]["base_gpu_id"] == 0
    # The peer validates against the first rank's engine: context 32 - 2, vocab 100.
    assert second["max_seq_len"] == first["max_seq_len"] == 30
    assert second["vocab_size"] == 100


def test_sglang_tp2_every_rank_gets_the_completions_in_the_same_order(ranks):
    first, second = ranks["sglang_tp2"]
    assert first["generate"] == second["generate"] and len(first["generate"]) == 4
    assert first["streamed"] == second["streamed"]
    # Finishing order (the fake answers prompt [1] before [9]), not request order.
    assert [c[0] for c in first["streamed"]] == [1, 0]
    assert all(seed is not None for seed in first["seen_seeds"])


def test_sglang_tp2_worker_r_loads_rank_r_copy(ranks):
    first, second = ranks["sglang_tp2"]
    weight = torch.arange(24.0).reshape(6, 4)
    for tp_rank, worker in enumerate(first["worker_weights"]):
        # Rank r marked its copy with +1000 r: worker r read rank r's (no cross-GPU copy).
        expected = weight[3 * tp_rank : 3 * tp_rank + 3] + 1000 * tp_rank
        torch.testing.assert_close(worker["model.layers.0.mlp.up_proj.weight"], expected)
    for rank in (first, second):
        assert "failed on bucket 0" in rank["update_error"]
        assert "shape mismatch" in rank["update_error"]
        assert "ranks [1] passed other tensors" in rank["names_error"]
    # Refused before SGLang was asked: no third update call.
    assert [c[0] for c in first["calls"]].count("update") == 2


def test_sglang_tp2_control_calls_run_once_and_failures_reach_every_rank(ranks):
    first, second = ranks["sglang_tp2"]
    assert [c[0] for c in first["calls"]] == ["update", "flush", "update", "release", "resume"]
    assert "scheduler died" in first["generate_error"]
    assert "failed on rank 0, the first of this engine's TP group" in second["generate_error"]


def test_sglang_tp1_on_two_ranks_puts_each_engine_on_its_own_gpu(ranks):
    for r, rank in enumerate(ranks["sglang_tp1"]):
        assert rank["has_engine"] and rank["group"] == (r,)
        assert rank["kwargs"]["tp_size"] == 1 and rank["kwargs"]["base_gpu_id"] == r
        assert len(rank["generate"]) == 4
        worker = rank["worker_weights"][0]  # its own copy, whole
        expected = torch.arange(24.0).reshape(6, 4) + 1000 * r
        torch.testing.assert_close(worker["model.layers.0.mlp.up_proj.weight"], expected)


# -- checks before anything loads ------------------------------------------------------------


@pytest.fixture
def fakes(monkeypatch):
    built = []
    modules = {**vllm_modules(), **sglang_modules()}
    for cls in (modules["vllm"].LLM, modules["sglang"].Engine):
        original = cls.__init__

        def init(self, *args, _original=original, **kwargs):
            built.append(type(self).__name__)
            _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", init)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(name, raising=False)
    return built


def _model_dir(tmp_path, heads: int, kv_heads: int) -> Path:
    config = {"architectures": [], "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_engine_tp_sizes_that_cannot_serve_are_refused_before_the_engine_loads(
    fakes, tmp_path, monkeypatch
):
    with pytest.raises(ValueError, match=r"VLLMConfig.tensor_parallel_size=0"):
        VLLMConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"SGLangConfig.tp_size=True"):
        SGLangConfig(tp_size=True)
    with pytest.raises(ValueError, match=r"llm_kwargs sets \['tensor_parallel_size'\]"):
        VLLMConfig(llm_kwargs={"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match=r"engine_kwargs sets \['tp_size'\]"):
        SGLangConfig(engine_kwargs={"tp_size": 2})
    # More ranks than the world (a plain process: a world of one).
    with pytest.raises(ValueError, match=r"VLLMConfig.tensor_parallel_size=2 must divide"):
        VLLMEngine("/models/x", config=VLLMConfig(tensor_parallel_size=2))
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"SGLangConfig.tp_size=3 must divide the world size 4"):
        SGLangEngine("/models/x", config=SGLangConfig(tp_size=3))
    # Another size than the policy's TP group.
    with pytest.raises(ValueError, match=r"differs from the policy's tp_size=4.*tp_size=4"):
        SGLangEngine("/models/x", config=SGLangConfig(tp_size=2), policy_tp_size=4)
    # Heads the size does not divide: 6 query heads over 4 ranks; 3 KV heads and 2 ranks.
    with pytest.raises(ValueError, match=r"does not divide the model's 6 attention heads"):
        VLLMEngine(_model_dir(tmp_path, 6, 6), config=VLLMConfig(tensor_parallel_size=4))
    with pytest.raises(ValueError, match=r"3 key/value heads"):
        check_engine_tp("f", 2, model_dir=_model_dir(tmp_path, 6, 3), world_size=4)
    # KV heads fewer than the ranks but dividing them are replicated: accepted.
    check_engine_tp("f", 4, model_dir=_model_dir(tmp_path, 8, 2), world_size=4)
    # A TP group across nodes (SGLang's workers run on one node).
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ValueError, match=r"tp_size=2 does not divide the 3 ranks per node"):
        SGLangEngine("/models/x", config=SGLangConfig(tp_size=2))
    # vLLM's external launcher needs torchrun.
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"launch with torchrun, or set it to 1"):
        VLLMEngine("/models/x", config=VLLMConfig(tensor_parallel_size=2))
    assert fakes == []  # no engine was built


def test_request_digest_sees_what_decides_the_samples():
    base = [Request(prompt_ids=[1, 2], metadata={"a": 1})]
    sampling = SamplingParams(max_new_tokens=4)
    digest = request_digest(base, sampling)
    assert request_digest([Request(prompt_ids=[1, 2], metadata={"b": 2})], sampling) == digest
    assert request_digest([Request(prompt_ids=[1, 3])], sampling) != digest
    assert request_digest([Request(prompt_ids=[1, 2], max_new_tokens=2)], sampling) != digest
    assert request_digest(base, SamplingParams(max_new_tokens=5)) != digest
    image = torch.zeros(3, 2, 2)
    with_image = request_digest([Request(prompt_ids=[1], images=[image])], sampling)
    assert request_digest([Request(prompt_ids=[1], images=[image + 1])], sampling) != with_image


# -- memory reports ----------------------------------------------------------------------------


def test_engines_report_weights_kv_pool_and_graphs(fakes, tiny_model_dir):
    from safetensors.torch import load_file

    num_params = sum(t.numel() for t in load_file(tiny_model_dir / "model.safetensors").values())
    total = 80 << 30
    vllm = VLLMEngine(
        tiny_model_dir, config=VLLMConfig(dtype="bfloat16", gpu_memory_utilization=0.4)
    )
    vllm.device_total_bytes = total
    need = vllm.memory_need()
    assert isinstance(need, MemoryNeed)
    # bf16: 2 bytes a parameter; the pool is 0.4 of the GPU, the KV cache what weights leave.
    assert need.resident["weights"] == 2 * num_params
    assert need.resident["kv_cache"] == int(0.4 * total) - 2 * num_params
    assert need.resident["cuda_graph"] == CUDA_GRAPH_BYTES_ESTIMATE
    assert need.peak == {} and "gpu_memory_utilization" in need.settings["kv_cache"]
    eager = VLLMEngine(tiny_model_dir, config=VLLMConfig(dtype="float32", enforce_eager=True))
    eager.device_total_bytes = total
    assert eager.memory_need().resident["weights"] == 4 * num_params
    assert eager.memory_need().resident["cuda_graph"] == 0
    sglang = SGLangEngine(
        tiny_model_dir,
        config=SGLangConfig(
            mem_fraction_static=0.3, engine_kwargs={"disable_cuda_graph": True}, dtype="float16"
        ),
    )
    sglang.device_total_bytes = total
    need = sglang.memory_need()
    assert need.resident == {
        "weights": 2 * num_params,
        "kv_cache": int(0.3 * total) - 2 * num_params,
        "cuda_graph": 0,
    }
    assert "mem_fraction_static" in need.settings["kv_cache"]
    # No GPU (CPU host) or no local checkpoint: nothing to report.
    sglang.device_total_bytes = None
    assert sglang.memory_need() is None
    hub = VLLMEngine("Qwen/Qwen2.5-7B")
    hub.device_total_bytes = total
    assert hub.memory_need() is None
    sglang.close()


def test_engine_memory_need_splits_weights_over_tp_ranks(tiny_model_dir):
    from safetensors.torch import load_file

    from yatt.rollout._engine_memory import served_weight_bytes

    num_params = sum(t.numel() for t in load_file(tiny_model_dir / "model.safetensors").values())
    assert served_weight_bytes(tiny_model_dir, "bfloat16", tp_size=2) == num_params
    # "auto": the checkpoint's declared dtype (the tiny model is saved in float32).
    config = json.loads((tiny_model_dir / "config.json").read_text())
    declared = {"float32": 4, "bfloat16": 2, "float16": 2}[config.get("torch_dtype", "float32")]
    assert served_weight_bytes(tiny_model_dir, "auto", tp_size=1) == declared * num_params


def test_a_plan_refuses_a_phase_the_engine_report_cannot_fit(fakes, tiny_model_dir):
    from yatt.placement import FitConfig, MemoryFitError, Plan

    engine = VLLMEngine(tiny_model_dir, config=VLLMConfig(gpu_memory_utilization=0.9))
    engine.device_total_bytes = 10 << 30
    # 0.9 x 10 GiB of pool and 1 GiB of graphs do not fit in 8 GiB: named before the step.
    fit = FitConfig(capacity_bytes=lambda: 8 << 30, headroom_bytes=0)
    plan = Plan(roles={"rollout": engine}, phases={"rollout": ["rollout"]}, fit=fit)
    with pytest.raises(MemoryFitError, match=r"VLLMConfig.gpu_memory_utilization"):
        plan.check_fit()
    engine.config.gpu_memory_utilization = 0.5
    assert [fit.phase for fit in plan.check_fit()] == ["rollout"]
