"""Shared fixtures: one tiny checkpoint and one full-size skeleton per test session."""
import pytest

from runtime.checkpoint.synth import make_checkpoint
from runtime.config import ModelConfig


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_checkpoint(ModelConfig.preset("tiny"), tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def full_skeleton(tmp_path_factory):
    return make_checkpoint(ModelConfig.preset("deepseek-v4.1-flash"), tmp_path_factory.mktemp("full"), skeleton=True)
