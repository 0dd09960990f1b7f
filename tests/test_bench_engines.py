"""bench/rollout/engines.py and engines_report.py on CPU: run parsing, argument errors, the plan,
the timing loop on a fake engine, and the report's ratios from hand-built results."""

NUM_GPUS = 0

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "rollout" / "engines.py"
sys.path.insert(0, str(SCRIPT.parent))
import engines
import engines_report


def args_of(*argv: str):
    return engines.parse_args(list(argv))


# ---- runs and arguments --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "engine", "shape", "modes"),
    [
        ("builtin:0.5b", "builtin", "0.5b", {"adapter_seeded"}),
        ("vllm:1.5b:native", "vllm", "1.5b", {"native_seeded", "native_unseeded"}),
        # inproc: vLLM's own LLM.generate on the adapter's in-process engine
        (
            "vllm:7b:adapter",
            "vllm",
            "7b",
            {"adapter_seeded", "adapter_unseeded", "inproc_unseeded"},
        ),
        # SGLang's seeding is fixed at start-up (deterministic mode): one process per seeding.
        ("sglang:0.5b:seeded", "sglang", "0.5b", {"adapter_seeded", "native_seeded"}),
        ("sglang:0.5b:unseeded", "sglang", "0.5b", {"adapter_unseeded", "native_unseeded"}),
    ],
)
def test_parse_run(spec, engine, shape, modes):
    run = engines.parse_run(spec)
    assert (run.engine, run.shape, set(run.modes)) == (engine, shape, modes)
    assert run.tag == spec.replace(":", "_")


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("tgi:0.5b", "engine 'tgi'"),
        ("vllm", "give a shape"),
        ("vllm:3b:native", "give a shape"),
        ("vllm:0.5b", "group is one of ['adapter', 'native']"),  # adapter and native can't share
        ("builtin:0.5b:native", "group is one of ['none']"),
        ("sglang:0.5b:seeded:x", "group is one of"),
    ],
)
def test_parse_run_rejects(spec, names):
    with pytest.raises(ValueError, match=names.replace("[", r"\[").replace("]", r"\]")):
        engines.parse_run(spec)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "give one of --run, --prepare or --report"),
        (["--run", "builtin:0.5b", "--report", "a.json", "--md", "x"], "give one of"),
        (["--run", "builtin:0.5b"], "--run needs --out"),
        (["--report", "a.json"], "--report needs --md"),
        (["--run", "vllm:0.5b", "--dry-run"], "vllm's group"),
        (["--prepare", "0.5b,2b"], "give a shape"),
        (["--run", "builtin:0.5b", "--dry-run", "--batches", "64,0"], "integers >= 1"),
        (["--run", "builtin:0.5b", "--dry-run", "--batches", "a"], "integers separated"),
        (["--run", "builtin:0.5b", "--dry-run", "--repeats", "0"], "--repeats must be >= 1"),
        (["--run", "builtin:0.5b", "--dry-run", "--memory", "1.5"], "--memory"),
        (["--run", "sglang:0.5b:seeded", "--dry-run", "--sglang-attention", "fa4"], "fa4"),
    ],
)
def test_bad_arguments_exit_with_the_reason(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        engines.parse_args(argv)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err


def test_help_and_dry_run_load_nothing():
    """--help and --dry-run work on a machine without a GPU or the engines."""
    run = [sys.executable, str(SCRIPT)]
    assert subprocess.run([*run, "--help"], capture_output=True, check=True).stdout
    out = subprocess.run(
        [*run, "--run", "vllm:1.5b:native", "--dry-run", "--model-root", "/nonexistent"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    plan = json.loads(out)
    assert plan["modes"] == ["native_unseeded", "native_seeded"]
    assert plan["settings"]["VLLM_ENABLE_V1_MULTIPROCESSING"].startswith("1")
    assert plan["workload"]["judge"] == {"batch": 256, "prompt_tokens": 1024, "new_tokens": 128}
    assert not Path("/nonexistent").exists()


# ---- settings ------------------------------------------------------------------------------------


def test_sglang_attention_takes_the_first_backend_whose_kernels_are_here():
    usable = {"fa3": "no kernels", "flashinfer": None, "triton": None}
    assert engines.sglang_attention_choice(["fa3", "flashinfer", "triton"], usable) == (
        "flashinfer",
        {"fa3": "no kernels"},
    )
    assert engines.sglang_attention_choice(["triton", "fa3"], usable) == ("triton", {})
    with pytest.raises(ValueError, match="none usable"):
        engines.sglang_attention_choice(["fa3"], usable)


def test_sglang_samples_with_pytorch_when_flashinfer_cannot_build():
    args = args_of("--run", "sglang:0.5b:unseeded", "--dry-run")
    run = args.run_spec
    no_flashinfer = {"fa3": "none", "flashinfer": "no nvcc", "triton": None}
    settings = engines.engine_settings(run, args, no_flashinfer)
    assert settings["attention_backend"] == "triton"
    assert settings["sampling_backend"] == "pytorch"
    assert settings["enable_deterministic_inference"] is False
    assert set(settings["attention_backends_skipped"]) == {"fa3", "flashinfer"}
    with_flashinfer = {"fa3": None, "flashinfer": None, "triton": None}
    settings = engines.engine_settings(run, args, with_flashinfer)
    assert settings["attention_backend"] == "fa3" and "sampling_backend" not in settings


def test_engines_get_room_for_the_largest_batch_and_the_longest_sequence():
    args = args_of("--run", "vllm:0.5b:adapter", "--dry-run", "--batches", "64,300")
    settings = engines.engine_settings(args.run_spec, args, None)
    # judge: 1,024 + 128 = 1,152 > decode's 128 + 512; batch 300 > the judge's 256
    assert settings["max_model_len"] == 1152
    assert settings["max_num_seqs"] == 300
    assert settings["VLLM_ENABLE_V1_MULTIPROCESSING"].startswith("0")


# ---- the timing loop on a fake engine ------------------------------------------------------------


class FakeSGLang:
    """SGLang's Engine.generate: one dict per prompt, `short` tokens fewer than asked."""

    def __init__(self, short: int = 0):
        self.calls: list[tuple[list[list[int]], list[dict]]] = []
        self.short = short

    def generate(self, input_ids, sampling_params, return_logprob):
        self.calls.append((input_ids, sampling_params))
        return [{"output_ids": [0] * (p["max_new_tokens"] - self.short)} for p in sampling_params]


def test_measure_mode_counts_forced_lengths_and_draws_fresh_prompts(monkeypatch):
    monkeypatch.setattr("torch.cuda.synchronize", lambda: None)
    args = args_of(
        "--run", "sglang:0.5b:seeded", "--dry-run", "--batches", "2,3", "--new-tokens", "5",
        "--judge-batch", "2", "--judge-prompt", "7", "--judge-new", "4", "--repeats", "2",
    )  # fmt: skip
    fake = FakeSGLang()
    out = engines.measure_mode(
        args.run_spec, types.SimpleNamespace(_engine=fake), "native_seeded", args
    )
    assert out["decode"]["2"]["tokens"] == 2 * 5 and out["decode"]["3"]["tokens"] == 3 * 5
    assert out["judge"]["prefill"]["tokens"] == 2 * 7  # prompt tokens only
    assert out["judge"]["total"]["tokens"] == 2 * (7 + 4)
    # per workload: a warm-up, then `repeats` timed calls; the judge's prefill calls ask 1 token
    asked = [params[0]["max_new_tokens"] for _, params in fake.calls]
    assert asked == [64, 5, 5, 64, 5, 5, 1, 1, 1, 4, 4]
    prompts = [tuple(map(tuple, ids)) for ids, _ in fake.calls]
    assert len(set(prompts)) == len(prompts)  # no call can hit another's prefix cache
    assert [len(ids[0]) for ids, _ in fake.calls][-5:] == [7] * 5
    seeds = [p["sampling_seed"] for p in fake.calls[1][1]]
    assert len(set(seeds)) == 2  # a seed per sample, distinct


def test_unseeded_native_calls_carry_no_seed(monkeypatch):
    monkeypatch.setattr("torch.cuda.synchronize", lambda: None)
    args = args_of("--run", "sglang:0.5b:unseeded", "--dry-run", "--batches", "2",
                   "--judge-batch", "1", "--judge-prompt", "3", "--repeats", "1")  # fmt: skip
    fake = FakeSGLang()
    engines.measure_mode(
        args.run_spec, types.SimpleNamespace(_engine=fake), "native_unseeded", args
    )
    assert all("sampling_seed" not in p for _, params in fake.calls for p in params)


def test_a_short_sample_fails_the_call(monkeypatch):
    monkeypatch.setattr("torch.cuda.synchronize", lambda: None)
    run = engines.parse_run("sglang:0.5b:unseeded")
    engine = types.SimpleNamespace(_engine=FakeSGLang(short=1))
    with pytest.raises(RuntimeError, match="expected 2 x 8"):
        engines.timed(run, engine, "native_unseeded", 2, 4, 8, seed=0)


# ---- the report ----------------------------------------------------------------------------------


def summary(tok_s: float) -> dict:
    return {"tok_s": tok_s, "min_tok_s": tok_s * 0.9, "max_tok_s": tok_s * 1.1}


def mode_result(d64, d256, prefill, total) -> dict:
    return {
        "decode": {"64": summary(d64), "256": summary(d256)},
        "judge": {"prefill": summary(prefill), "total": summary(total)},
    }


def run_result(engine, shape, group, results, errors=None) -> dict:
    return {
        "run": "_".join(p for p in (engine, shape, group) if p),
        "engine": engine,
        "shape": shape,
        "device": "NVIDIA H200",
        "commit": "abc1234",
        "version": f"{engine} 1.0",
        "startup_s": 10.0,
        "settings": {"attention_backend": "triton"},
        "workload": {
            "decode": {"batches": [64, 256], "prompt_tokens": 128, "new_tokens": 512},
            "judge": {"batch": 256, "prompt_tokens": 1024, "new_tokens": 128},
            "repeats": 3,
        },
        "results": results,
        "errors": errors or {},
    }


def session() -> list[dict]:
    return [
        run_result("builtin", "0.5b", "", {"adapter_seeded": mode_result(100, 400, 900, 300)}),
        run_result(
            "vllm", "0.5b", "native",
            {"native_unseeded": mode_result(125, 200, 1000, 250),
             "native_seeded": mode_result(110, 190, 1000, 240)},
        ),
        run_result(
            "vllm", "0.5b", "adapter",
            {"adapter_seeded": mode_result(99, 95, 800, 200)},
            errors={"adapter_unseeded": "RuntimeError: boom"},
        ),
        run_result(
            "sglang", "0.5b", "unseeded",
            {"adapter_unseeded": mode_result(80, 500, 600, 350),
             "native_unseeded": mode_result(100, 500, 750, 350)},
        ),
        run_result("builtin", "1.5b", "", {"adapter_seeded": mode_result(50, 200, 500, 150)}),
        run_result("sglang", "1.5b", "unseeded", {}, errors={"startup": "ImportError: no fa3"}),
    ]  # fmt: skip


def test_builtin_ratio_is_against_the_best_row_of_either_engine_in_any_mode():
    rows = engines.table_rows(session())["0.5b"]
    ratios = engines.builtin_ratios(rows)
    assert ratios["decode 64"] == (100 / 125, "vLLM own API, unseeded")
    assert ratios["decode 256"] == (400 / 500, "SGLang through yatt, unseeded")  # first of a tie
    assert ratios["judge prefill"] == (900 / 1000, "vLLM own API, unseeded")
    assert ratios["judge total"] == (300 / 350, "SGLang through yatt, unseeded")


def test_builtin_ratio_is_absent_without_a_rival_or_a_builtin_row():
    by_shape = engines.table_rows(session())
    assert set(engines.builtin_ratios(by_shape["1.5b"]).values()) == {None}
    no_builtin = {k: v for k, v in by_shape["0.5b"].items() if k[0] != "builtin"}
    assert set(engines.builtin_ratios(no_builtin).values()) == {None}


def test_adapter_ratio_pairs_each_adapter_mode_with_the_same_seeding_own_api():
    ratios = engines.adapter_ratios(engines.table_rows(session())["0.5b"])
    assert ratios[("vllm", "seeded", "native")]["decode 256"] == pytest.approx(95 / 190)
    assert ratios[("sglang", "unseeded", "native")]["judge prefill"] == pytest.approx(600 / 750)
    assert ("vllm", "unseeded", "native") not in ratios  # its adapter mode failed: no pair
    assert ("vllm", "seeded", "inproc") not in ratios  # no in-process own-API run seeded
    assert all(engine != "builtin" for engine, _, _ in ratios)


def test_adapter_ratio_against_the_in_process_engine_splits_the_gap():
    results = session()
    results[2]["results"]["adapter_unseeded"] = mode_result(60, 100, 800, 200)
    results[2]["results"]["inproc_unseeded"] = mode_result(120, 150, 800, 200)
    ratios = engines.adapter_ratios(engines.table_rows(results)["0.5b"])
    # adapter / own API (100/200) = adapter / in-process (100/150) x in-process / own API
    assert ratios[("vllm", "unseeded", "native")]["decode 256"] == pytest.approx(100 / 200)
    assert ratios[("vllm", "unseeded", "inproc")]["decode 256"] == pytest.approx(100 / 150)
    text = engines.build_report(results)
    assert "| vLLM through yatt / own API (core in-process) | unseeded | 0.50x | 0.67x |" in text
    assert "| vLLM | own API, core in-process, unseeded | 120 (108-132) |" in text


def test_report_has_a_table_per_shape_the_bars_and_the_failures():
    text = engines.build_report(session())
    assert text.index("## 0.5B shape") < text.index("## 1.5B shape")
    bars = next(line for line in text.splitlines() if line.startswith("| built-in / best"))
    assert "**0.80x** vs vLLM own API, unseeded (bar: NOT met)" in bars
    assert "0.86x vs SGLang through yatt, unseeded" in bars  # judge total: no bar
    assert "| 100 (90-110) |" in text  # median (min-max)
    assert "ImportError: no fa3" in text and "RuntimeError: boom" in text
    assert "abc1234" in text and "NVIDIA H200" in text
    met = session()
    met[0]["results"]["adapter_seeded"] = mode_result(200, 600, 2000, 400)
    assert "(bar >= 1.0: met)" in engines.build_report(met)
    with pytest.raises(ValueError, match="no JSON files"):
        engines.build_report([])


def test_report_command_merges_the_files(tmp_path):
    paths = []
    for i, result in enumerate(session()):
        paths.append(tmp_path / f"engines_table_{i}.json")
        paths[-1].write_text(json.dumps(result))
    md = tmp_path / "engines.md"
    assert engines.main(["--report", *map(str, paths), "--md", str(md)]) == 0
    assert md.read_text().count("| built-in / best of vLLM and SGLang |") == 2


def test_report_module_writes_what_engines_report_writes(tmp_path):
    """engines_report.py's command and engines.py --report give the same file and stdout."""
    paths = []
    for i, result in enumerate(reversed(session())):  # files given out of order: both sort them
        paths.append(tmp_path / f"engines_table_{i}.json")
        paths[-1].write_text(json.dumps(result))
    files = list(map(str, paths))
    outs = []
    for argv in (
        [str(SCRIPT), "--report", *files, "--md", str(tmp_path / "a.md")],
        [str(SCRIPT.parent / "engines_report.py"), *files, "--md", str(tmp_path / "b.md")],
    ):
        outs.append(subprocess.run([sys.executable, *argv], capture_output=True, check=True).stdout)
    assert (tmp_path / "a.md").read_bytes() == (tmp_path / "b.md").read_bytes()
    assert outs[0] == outs[1] and outs[0].count(b"| built-in / best of vLLM and SGLang |") == 2


@pytest.mark.parametrize(
    ("argv", "says"),
    [(["--md", "x.md"], "files"), (["a.json"], "--md")],
)
def test_report_command_needs_files_and_md(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        engines_report.main(argv)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err


def test_report_module_imports_neither_the_runner_nor_torch():
    """The report reads JSON alone: it runs where no engine or torch is installed."""
    code = (
        f"import sys; sys.path.insert(0, {str(SCRIPT.parent)!r}); import engines_report; "
        "print(sorted({'engines', 'torch'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_summarize_reports_median_min_and_max_rates():
    # 8 tokens in 2 s, 1 s and 4 s: 4, 8 and 2 tok/s
    assert engines.summarize([2.0, 1.0, 4.0], 8) | {"seconds": None} == {
        "seconds": None, "tokens": 8, "tok_s": 4.0, "min_tok_s": 2.0, "max_tok_s": 8.0,
    }  # fmt: skip


def test_report_columns_follow_the_batches_run():
    results = session()[:2]
    for r in results:
        r["workload"]["decode"]["batches"] = [256, 32]
        for row in r["results"].values():
            row["decode"]["32"] = row["decode"].pop("64")
    assert engines.columns_of(results) == (
        "decode 32",
        "decode 256",
        "judge prefill",
        "judge total",
    )
    header = next(
        line for line in engines.build_report(results).splitlines() if "| engine |" in line
    )
    assert "decode 32 tok/s | decode 256 tok/s" in header


def test_batches_none_runs_the_judge_like_load_alone(monkeypatch):
    args = engines.parse_args(["--run", "builtin:0.5b", "--batches", "none", "--out", "x.json"])
    assert args.batches == []
    calls = []
    monkeypatch.setattr(
        engines, "timed", lambda run, e, mode, b, p, n, seed: calls.append((b, p, n)) or 1.0
    )
    out = engines.measure_mode(args.run_spec, None, "adapter_seeded", args)
    assert out["decode"] == {} and set(out["judge"]) == {"prefill", "total"}
    assert {(b, p) for b, p, _ in calls} == {(256, 1024)}, "no decode call ran"
    results = session()[:2]
    for r in results:
        r["workload"]["decode"]["batches"] = []
    assert engines.columns_of(results) == ("judge prefill", "judge total")


def test_resolved_settings_read_back_what_vllm_settled_on(monkeypatch):
    ns = types.SimpleNamespace
    config = ns(
        compilation_config=ns(cudagraph_capture_sizes=[1, 2, 4, 256], cudagraph_mode="FULL"),
        scheduler_config=ns(async_scheduling=True, max_num_batched_tokens=16384, max_num_seqs=256),
        cache_config=ns(enable_prefix_caching=True),
        attention_config=ns(backend=None),
    )
    llm = ns(llm_engine=ns(vllm_config=config))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    native = engines.resolved_settings(engines.parse_run("vllm:0.5b:native"), llm)
    assert native["async_scheduling"] is True
    assert native["cudagraph_capture_sizes"] == "1..256 (4)"
    assert native["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    adapter = engines.resolved_settings(engines.parse_run("vllm:0.5b:adapter"), ns(_llm=llm))
    assert adapter["max_num_batched_tokens"] == 16384
