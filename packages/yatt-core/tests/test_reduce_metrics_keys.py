"""reduce_metrics over ranks whose key sets differ (a count by cause that one rank never saw):
summed, min'd and max'd keys meet in their union; a missing "mean" key or a key reduced two ways
is a ValueError on every rank, never gloo's abort on a gather of unequal lengths."""

NUM_GPUS = 0


from yatt.testing import run_rank_script

_WORKER = """
    import json, sys
    import torch.distributed as dist
    from yatt.core import reduce_metrics

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cases = {
        # rank 0 saw cause a, rank 1 saw cause b; "worst" is a max, "n" a sum
        "union": (
            [{"n": 1.0, "cause/a": 2.0, "worst": 7.0}, {"n": 3.0, "cause/b": 5.0}],
            {"n": "sum", "cause/a": "sum", "cause/b": "sum", "worst": "max"},
        ),
        "mean_missing": ([{"loss": 1.0, "x": 1.0}, {"x": 2.0}], {"x": "sum"}),
        "two_ops": ([{"x": 1.0, "y": 1.0}, {"x": 2.0}], {"x": "sum", "y": "sum"}),
    }
    out = {}
    for name, (per_rank, all_ops) in cases.items():
        mine = per_rank[rank]
        ops = {k: v for k, v in all_ops.items() if k in mine}
        if name == "two_ops" and rank == 1:
            ops = {"x": "max"}
        try:
            out[name] = reduce_metrics(mine, ops=ops)
        except ValueError as exc:
            out[name] = "ValueError: " + str(exc)
    # the same keys on every rank still take the one-gather path
    out["same"] = reduce_metrics({"x": float(rank)}, ops={"x": "sum"})
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
    """


def test_ranks_with_different_keys_reduce_over_the_union_or_all_raise(tmp_path):
    results = run_rank_script(_WORKER, 2, tmp_path)
    for result in results:
        assert result["union"] == {"n": 4.0, "cause/a": 2.0, "cause/b": 5.0, "worst": 7.0}
        assert result["mean_missing"].startswith("ValueError")
        assert "'loss'" in result["mean_missing"] and "[1]" in result["mean_missing"]
        assert result["two_ops"].startswith("ValueError") and "'x'" in result["two_ops"]
        assert result["same"] == {"x": 1.0}
