NUM_GPUS = 0

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from yatt.testing import make_tiny_causal_lm, make_tokenizer


@pytest.mark.parametrize(
    "text", ["", "hello", "2+2=4", "naive cafe \u00e9\u00e8 \u4e2d\u6587", "  spaces\n\ttab"]
)
def test_tokenizer_round_trips_any_text(text):
    tok = make_tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_chat_template_renders_generation_prompt():
    tok = make_tokenizer()
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_saved_model_loads_and_matches(tmp_path, arch):
    model = make_tiny_causal_lm(tmp_path, arch=arch, seed=3)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = torch.tensor([tok("abc", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, loaded(ids).logits)
    assert len(tok) <= loaded.config.vocab_size
    text = "x = 12 * 3\n\u00e9"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert tok.eos_token_id == make_tokenizer().eos_token_id


def test_seed_controls_weights():
    a = make_tiny_causal_lm(seed=1).state_dict()
    b = make_tiny_causal_lm(seed=1).state_dict()
    c = make_tiny_causal_lm(seed=2).state_dict()
    key = next(iter(a))
    assert torch.equal(a[key], b[key])
    assert not torch.equal(a[key], c[key])


def test_run_ranks_sets_the_distributed_env_and_reports_failed_ranks(tmp_path):
    import sys

    from yatt.testing import run_ranks

    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys\n"
        "print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_PORT'])\n"
        "sys.exit(int(os.environ['RANK']) == int(sys.argv[1]))\n"
    )
    logs = run_ranks([sys.executable, str(script), "-1"], 3)
    ranks = [line.split() for line in logs]
    assert [r[:2] for r in ranks] == [["0", "3"], ["1", "3"], ["2", "3"]]
    assert len({r[2] for r in ranks}) == 1  # one shared MASTER_PORT
    with pytest.raises(AssertionError, match="--- rank 1 ---"):
        run_ranks([sys.executable, str(script), "1"], 2)
