import pytest
import torch

# Tiny models gain nothing from intra-op threads, and the test machines share 2 cores: spinning
# OpenMP threads made steps several times slower under load.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from yatt.testing import make_tiny_causal_lm

    path = tmp_path_factory.mktemp("tiny-qwen2")
    make_tiny_causal_lm(path, arch="qwen2", seed=0, max_position_embeddings=512)
    return path
