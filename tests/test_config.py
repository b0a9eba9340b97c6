"""Engine options are validated when the config is built; a bad value names its field and the fix."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig

pytestmark = pytest.mark.engine


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("blas_library", "rocblas", "blas_library: must be cublas or cublaslt"),
        ("dtype", "int8", "dtype: must be one of"),
        ("device", "tpu", "device: must be auto, cpu, cuda or cuda:N"),
        ("max_model_len", 0, "max_model_len: must be >= 1"),
        ("num_blocks", 0, "num_blocks: must be >= 1 or None"),
    ],
)
def test_bad_option_names_its_field(option, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs("models/any", **{option: value})


def test_unknown_option_is_refused():
    with pytest.raises(ValueError, match="unknown engine option 'blas'"):
        EngineConfig.from_kwargs("models/any", blas="cublas")


def test_options_reach_their_component():
    config = EngineConfig.from_kwargs("models/any", blas_library="cublas", block_size=32, max_num_seqs=8)
    assert config.load.blas_library == "cublas"
    assert (config.cache.block_size, config.scheduler.max_num_seqs) == (32, 8)
