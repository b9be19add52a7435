"""After new weights are loaded into the running vLLM engine, its prefix cache must be empty: a cached
prompt prefix holds the previous model's keys and values, and a prompt sharing it (the chat
template's start) would be scored partly by that model. vLLM refuses the reset while a request
still holds blocks; bema then stops with one line instead of scoring with two models mixed."""

from __future__ import annotations

import pytest
from conftest import vllm_available

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason="vllm is not importable")]


def test_a_swap_stops_when_the_prefix_cache_cannot_be_reset(tiny_model_dir, tiny_trained_dir, monkeypatch):
    from vllm import SamplingParams

    from bema_cli.errors import BackendError
    from bema_cli.eval.backends import vllm_backend
    from bema_cli.eval.backends.base import EngineOptions

    backend = vllm_backend.VllmBackend(EngineOptions(dtype="float32"))
    backend.load(tiny_model_dir)
    text = backend.tokenizer.apply_chat_template(
        [{"role": "user", "content": "How many coins?"}], tokenize=False
    )
    ids = backend.tokenizer.encode(text)
    ((before, tokens),) = backend.loss([ids])
    engine = backend.llm.llm_engine
    try:
        # a request left running holds its KV blocks: vLLM cannot reset the prefix cache now (long
        # enough to still run where the engine core works on in its own process)
        params = SamplingParams(max_tokens=backend.max_model_len - len(ids) - 1, ignore_eos=True)
        engine.add_request("held", {"prompt_token_ids": ids}, params)
        engine.step()
        assert backend.llm.reset_prefix_cache() is False  # the situation this test is about
        monkeypatch.setattr(vllm_backend, "RESET_WAIT_S", 0.3)
        with pytest.raises(BackendError, match="prefix cache still holds the previous weights"):
            backend.load(tiny_trained_dir)
    finally:
        engine.abort_request(["held"])
    # once the blocks are free the same swap goes through, and the trained weights score the text
    backend.load(tiny_trained_dir)
    ((after, _),) = backend.loss([ids])
    backend.close()
    assert tokens > 0 and abs(after - before) > 1e-3 * before
    fresh = vllm_backend.VllmBackend(EngineOptions(dtype="float32"))
    fresh.load(tiny_trained_dir)
    try:  # as a fresh engine on the trained checkpoint scores it (vLLM: not bitwise across engines)
        assert fresh.loss([ids])[0][0] == pytest.approx(after, rel=1e-5)
    finally:
        fresh.close()
