"""RequestStream (async_engine.py): a reader that keeps up gets every delta as it was put; with merge on,
one that is behind gets the waiting deltas merged into one (text, token ids and log-probs appended, the last finish),
without touching the lists the engine handed over; an error after them is raised on the next read."""
import asyncio

from tallow.engine.async_engine import RequestStream
from tallow.engine.errors import EngineStepError
from tallow.engine.outputs import CompletionOutput, Logprob, RequestOutput


class _Engine:
    def __init__(self):
        self.aborted = []

    def abort(self, rid):
        self.aborted.append(rid)


def delta(*outs, finished=False, cached=0):
    return RequestOutput("r", None, [1, 2], list(outs), finished, cached, delta=True)


def co(i, text, ids, finish=None, lps=None):
    return CompletionOutput(i, text, list(ids), None, lps, finish, None)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_a_reader_that_keeps_up_gets_each_delta():
    async def main():
        s = RequestStream(_Engine(), "r")
        s.merge = True
        got = []
        for k in range(3):
            s._put(delta(co(0, f"t{k}", [k]), finished=k == 2))
            got.append(await s.__anext__())
        assert [o.outputs[0].text for o in got] == ["t0", "t1", "t2"]
        assert [o.outputs[0].token_ids for o in got] == [[0], [1], [2]]
        assert s.finished
        assert [o async for o in s] == []
    run(main())


def test_a_reader_behind_gets_the_waiting_deltas_merged():
    async def main():
        s = RequestStream(_Engine(), "r")
        s.merge = True
        lp = [{5: Logprob(-0.5)}]
        first_ids, second_ids = [5], [6, 7]
        s._put(delta(co(0, "Hel", first_ids, lps=lp), co(1, "a", [9])))
        s._put(delta(co(0, "lo", second_ids, lps=[{6: Logprob(-1.0)}, {7: Logprob(-2.0)}]), co(1, "", [])))
        s._put(delta(co(0, " world", [8], finish="stop"), co(1, "b", [10], finish="length"), finished=True, cached=4))
        outs = [o async for o in s]
        assert len(outs) == 1
        out = outs[0]
        assert out.finished and out.num_cached_tokens == 4
        a, b = out.outputs
        assert (a.index, a.text, a.token_ids, a.finish_reason) == (0, "Hello world", [5, 6, 7, 8], "stop")
        assert [list(e) for e in a.logprobs] == [[5], [6], [7]]
        assert (b.index, b.text, b.token_ids, b.finish_reason) == (1, "ab", [9, 10], "length")
        assert first_ids == [5] and second_ids == [6, 7] and len(lp) == 1  # the engine's lists, untouched
    run(main())


def test_an_error_after_waiting_deltas_comes_on_the_next_read():
    async def main():
        s = RequestStream(_Engine(), "r")
        s.merge = True
        s._put(delta(co(0, "a", [1])))
        s._put(delta(co(0, "b", [2])))
        s._put(EngineStepError("boom"))
        out = await s.__anext__()
        assert out.outputs[0].text == "ab" and not out.finished
        try:
            await s.__anext__()
        except EngineStepError as e:
            assert "boom" in str(e)
        else:
            raise AssertionError("the error was lost")
        assert s.finished
    run(main())


def test_nothing_is_merged_past_the_finished_delta():
    async def main():
        s = RequestStream(_Engine(), "r")
        s.merge = True
        s._put(delta(co(0, "a", [1], finish="stop"), finished=True))
        s._put(delta(co(0, "late", [2])))  # e.g. an abort's output racing the end
        out = await s.__anext__()
        assert out.outputs[0].text == "a" and out.finished
    run(main())


def test_a_reader_cancelled_while_waiting_leaves_the_stream_usable():
    async def main():
        s = RequestStream(_Engine(), "r")
        s.merge = True
        t = asyncio.ensure_future(s.__anext__())
        await asyncio.sleep(0.01)
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        s._put(delta(co(0, "x", [3]), finished=True))  # no error from the cancelled waiter
        out = await asyncio.wait_for(s.__anext__(), 1)
        assert out.outputs[0].text == "x"
    run(main())


def test_a_waiting_reader_wakes_on_put():
    async def main():
        s = RequestStream(_Engine(), "r")
        s.merge = True
        t = asyncio.ensure_future(s.__anext__())
        await asyncio.sleep(0.01)
        assert not t.done()
        s._put(delta(co(0, "y", [4])))
        assert (await asyncio.wait_for(t, 1)).outputs[0].text == "y"
    run(main())


def test_without_merge_a_reader_behind_still_gets_each_delta():
    async def main():
        s = RequestStream(_Engine(), "r")  # merge is off unless the reader asks for it
        s._put(delta(co(0, "a", [1])))
        s._put(delta(co(0, "b", [2]), finished=True))
        assert [o.outputs[0].text async for o in s] == ["a", "b"]
    run(main())
