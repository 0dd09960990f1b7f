"""What the engine table's runner (engines.py) and its report (engines_report.py) both need: the
model shapes it measures and the engines' names. Neither module imports the other's internals."""

from __future__ import annotations

# Qwen2.5 shapes (their config.json), random bf16 weights. The report orders its tables by this.
SHAPES: dict[str, dict] = {
    "0.5b": dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
    ),
    "1.5b": dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
    ),
    "7b": dict(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False,
    ),
}  # fmt: skip
ENGINES = ("builtin", "vllm", "sglang")
# How the report names them.
ENGINE_NAMES = {"builtin": "built-in", "vllm": "vLLM", "sglang": "SGLang"}
