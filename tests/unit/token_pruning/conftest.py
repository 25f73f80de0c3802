import numpy as np
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)
