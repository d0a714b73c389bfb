"""Sampling defaults from the model's generation_config.json (vLLM's --generation-config auto): the
file's temperature, top_p, top_k, min_p and repetition_penalty fill what a request leaves unset,
below the server-wide defaults and the request's own values; --generation-config vllm ignores them.
Checked on the resolved SamplingParams, not on sampled text."""
import json
import logging

import pytest

from server_harness import write_tiny_llama
from tallow.engine.arg_parser import add_engine_args, engine_args_from
from tallow.engine.args import EngineArgs
from tallow.engine.input_processor import InputProcessor
from tallow.engine.sampling_params import SamplingParams
from tallow.loader.generation_config import sampling_defaults

FILE = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
        "do_sample": True, "bos_token_id": 0, "eos_token_id": 1, "transformers_version": "4.51.0"}


def sampling(p: SamplingParams) -> dict:
    return {k: getattr(p, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                       "frequency_penalty")}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = write_tiny_llama(tmp_path_factory.mktemp("genconf") / "model")
    (d / "generation_config.json").write_text(json.dumps(FILE))
    return d


def test_the_file_is_read_and_bad_values_left_out(tmp_path, caplog):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps(FILE))
    assert sampling_defaults(str(path)) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                                            "repetition_penalty": 1.1}
    path.write_text(json.dumps({"temperature": -1, "top_p": 0.0, "top_k": 40.0, "min_p": "x",
                                "repetition_penalty": None}))
    with caplog.at_level(logging.WARNING, "tallow.loader"):
        assert sampling_defaults(str(path)) == {"top_k": 40}
    assert "temperature=-1" in caplog.text and "top_p=0.0" in caplog.text and "min_p='x'" in caplog.text
    path.write_text("{not json")
    assert sampling_defaults(str(path)) == {}
    assert sampling_defaults(None) == {} and sampling_defaults(str(tmp_path / "absent.json")) == {}


def test_layers_request_then_server_then_file_then_builtin(tmp_path, caplog):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"temperature": 0.6, "top_k": 20}))
    ip = InputProcessor(EngineArgs(model="m", frequency_penalty=0.5), None, 0, 0)
    with caplog.at_level(logging.INFO, "tallow.engine"):
        ip.use_generation_config(str(path))
    assert caplog.text.count("sampling defaults from") == 1 and "temperature=0.6, top_k=20" in caplog.text
    got = sampling(ip.apply_defaults(SamplingParams()))
    assert got == {"temperature": 0.6, "top_p": 1.0, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.0,
                   "frequency_penalty": 0.5}
    got = sampling(ip.apply_defaults(SamplingParams(temperature=0.0, top_k=-1, frequency_penalty=0.0)))
    assert got["temperature"] == 0.0 and got["top_k"] == -1 and got["frequency_penalty"] == 0.0  # the request wins
    vllm = InputProcessor(EngineArgs(model="m", generation_config="vllm"), None, 0, 0)
    assert vllm.use_generation_config(str(path)) == {}
    assert sampling(vllm.apply_defaults(SamplingParams()))["temperature"] == 1.0


def test_the_engine_takes_the_models_file(model_dir):
    from tallow.engine.engine import LLMEngine

    eng = LLMEngine(EngineArgs(model=str(model_dir), num_kv_blocks=16))
    _, _, params = eng.input_processor.process("t5 t6", SamplingParams(max_tokens=2))
    assert sampling(params) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                                "repetition_penalty": 1.1, "frequency_penalty": 0.0}
    eng = LLMEngine(EngineArgs(model=str(model_dir), num_kv_blocks=16, generation_config="vllm"))
    _, _, params = eng.input_processor.process("t5 t6", SamplingParams(max_tokens=2))
    assert params.temperature == 1.0 and params.top_k == -1


def test_a_server_request_without_temperature_samples_with_the_files_settings(model_dir):
    requests = pytest.importorskip("requests")
    from server_harness import ServerThread
    from tallow.engine.engine import LLMEngine

    eng = LLMEngine(EngineArgs(model=str(model_dir), num_kv_blocks=16))
    seen = []
    real = eng.input_processor.process

    def process(prompt, params):
        out = real(prompt, params)
        seen.append(out[2])
        return out

    eng.input_processor.process = process
    srv = ServerThread(eng)
    try:
        url = srv.base_url + "/v1/chat/completions"
        msgs = [{"role": "user", "content": "t5 t6"}]
        assert requests.post(url, json={"messages": msgs, "max_tokens": 2}).status_code == 200
        assert sampling(seen[-1])["temperature"] == 0.6 and seen[-1].top_k == 20 and seen[-1].top_p == 0.95
        r = requests.post(url, json={"messages": msgs, "max_tokens": 2, "temperature": 1.0, "top_k": -1})
        assert r.status_code == 200
        assert (seen[-1].temperature, seen[-1].top_k, seen[-1].min_p) == (1.0, -1, 0.05)
        r = requests.post(srv.base_url + "/v1/completions", json={"prompt": "t5", "max_tokens": 2})
        assert r.status_code == 200 and seen[-1].repetition_penalty == 1.1
    finally:
        srv.stop()


def test_the_flag():
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_args_from(p.parse_args(["--w", "x"])).generation_config == "auto"
    assert engine_args_from(p.parse_args(["--w", "x", "--generation-config", "vllm"])).generation_config == "vllm"
    with pytest.raises(ValueError, match="generation_config must be auto or vllm"):
        EngineArgs(model="m", generation_config="mine")
