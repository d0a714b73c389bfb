"""A load test: 64 concurrent streaming clients, a third of them disconnecting midway; the others
get exactly the offline engine's greedy text; afterwards every KV block is back in the pool and the
server still answers."""
import asyncio

import pytest

openai = pytest.importorskip("openai")

from server_harness import ServerThread, write_tiny_llama  # noqa: E402
from tallow import LLM, SamplingParams  # noqa: E402
from tallow.engine.args import EngineArgs  # noqa: E402
from tallow.engine.engine import LLMEngine  # noqa: E402

N_CLIENTS = 64
N_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("load") / "m", seed=21)


def test_64_streaming_clients_some_disconnecting(model_dir):
    prompts = [[{"role": "user", "content": f"t{10 + i % 50} t{60 + i} t{200 - i}"}] for i in range(N_CLIENTS)]
    offline = LLM(str(model_dir), num_kv_blocks=256)
    tok = offline.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    refs = [o.outputs[0].text for o in offline.generate(
        [{"prompt_token_ids": tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True)} for p in prompts],
        params)]
    # 48 blocks of 16 tokens for 64 sequences of ~30 tokens: the scheduler must queue and preempt
    srv = ServerThread(LLMEngine(EngineArgs(model=str(model_dir), num_kv_blocks=48, max_num_seqs=32)))
    preempted = []
    sched = srv.llm_engine.scheduler
    orig = sched._preempt
    sched._preempt = lambda victim, out: (preempted.append(victim.request_id), orig(victim, out))
    try:
        async def client(c, i):
            stream = await c.chat.completions.create(model="tiny", messages=prompts[i], max_tokens=N_TOKENS,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            text, n = "", 0
            async for ch in stream:
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    n += 1
                    # disconnect midway (a reader that fell behind gets several tokens per chunk, so
                    # leave after the second chunk unless that one already ended the stream)
                    if i % 3 == 0 and n == 2 and ch.choices[0].finish_reason is None:
                        await stream.close()
                        return None
            return text

        async def main():
            c = openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
            try:
                return await asyncio.gather(*(client(c, i) for i in range(N_CLIENTS)))
            finally:
                await c.close()

        results = asyncio.run(main())
        for i, (got, ref) in enumerate(zip(results, refs)):
            if got is not None or i % 3:
                assert got == ref, i
        assert sum(r is None for r in results) >= N_CLIENTS // 6  # most of the leavers left midway
        srv.wait_idle(timeout=60)
        free, total = srv.pool_state()
        assert free == total == 48
        assert preempted, "the small cache should have forced preemption"
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="tiny", messages=prompts[1], max_tokens=N_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == refs[1]
        srv.wait_idle()
    finally:
        srv.stop()
