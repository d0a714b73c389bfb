"""Output processing: the engine core's per-token results become RequestOutputs: detokenization,
stop strings, log-prob entries, delta or final-only outputs, n > 1 groups (vLLM v1's
OutputProcessor). It holds the tokenizer and no scheduler, KV manager or device state: with an
engine core in its own process, this part runs in the API process.

The core decides the stops it can see without text (stop token ids, EOS, max_tokens, the context
length) and sends, per sampled token, a CoreOutput tuple:

    (request id, token id, log-prob entry or None, finish reason or None, stop reason, number of
     output tokens including this one, number of prompt tokens served from the prefix cache)

where the log-prob entry is (logprob, rank, [(token, logprob)] or None). A stop string is found
here; process() returns the ids of the requests it stopped, which the core then finishes."""
from __future__ import annotations

from typing import Optional

from tallow.engine.outputs import CompletionOutput, Logprob, RequestOutput
from tallow.engine.sampling_params import SamplingParams


class _Sequence:
    """Output state of one completion (one engine request) of a request group."""

    __slots__ = ("index", "req_id", "params", "detok", "text", "token_ids", "sent_text", "sent_tokens", "logprobs",
                 "sent_logprobs", "cumulative_logprob", "finish_reason", "stop_reason", "max_stop_len", "hold",
                 "plain")

    def __init__(self, index: int, req_id: str, params: SamplingParams, detok, max_stop_len: int):
        self.index = index
        self.req_id = req_id
        self.params = params
        self.detok = detok
        self.text = ""
        self.token_ids: list[int] = []
        self.sent_text = 0  # characters already returned in deltas
        self.sent_tokens = 0
        self.logprobs: Optional[list[dict[int, Logprob]]] = [] if params.logprobs is not None else None
        self.sent_logprobs = 0
        self.cumulative_logprob = 0.0 if params.logprobs is not None else None
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.max_stop_len = max_stop_len
        self.hold = max(max_stop_len - 1, 0)  # characters held back while running: a stop string's possible start
        # no log-probs, no stop strings, text wanted: a running token needs only detokenizing (process's fast path)
        self.plain = self.logprobs is None and not params.stop and params.detokenize


class RequestState:
    """One request as the API side sees it: a group of n completions."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_ids: list[int], params: SamplingParams,
                 final_only: bool = False):
        self.request_id = request_id
        self.final_only = final_only  # step() returns this group's output once, when it finishes
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.seqs: list[_Sequence] = []
        self.num_cached_tokens = 0
        # prompt_logprobs: entries by prompt position as they arrive (chunks), then the whole list
        self.prompt_lp: Optional[dict[int, dict[int, Logprob]]] = {} if params.prompt_logprobs is not None else None
        self.prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
        if self.prompt_lp is not None and len(prompt_ids) == 1:
            self.prompt_logprobs = [None]

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    @property
    def has_output(self) -> bool:
        return not self.final_only or self.finished


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestState] = {}
        self.seq_of: dict[str, tuple[RequestState, _Sequence]] = {}

    def add_request(self, group: RequestState, seq_params: list[tuple[str, SamplingParams]]) -> None:
        """Register a request group; seq_params: (engine request id, parameters) per completion."""
        from tallow.tokenizer import detokenizer_for

        max_stop = max((len(s) for s in group.params.stop), default=0)
        for i, (rid, p) in enumerate(seq_params):
            detok = detokenizer_for(self.tokenizer, prompt_ids=group.prompt_ids, skip_special_tokens=p.skip_special_tokens)
            seq = _Sequence(i, rid, p, detok, max_stop)
            group.seqs.append(seq)
            self.seq_of[rid] = (group, seq)
        self.groups[group.request_id] = group

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request group; returns the engine request ids of its unfinished completions."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return []
        ids = []
        for seq in group.seqs:
            if self.seq_of.pop(seq.req_id, None) is not None:
                ids.append(seq.req_id)
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        return ids

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    # -- one step's results -------------------------------------------------------------------------
    def process(self, outputs: list[tuple], prompt_logprobs: Optional[dict] = None
                ) -> tuple[list[RequestOutput], list[str]]:
        """Apply a step's CoreOutputs (module docstring); returns (a RequestOutput per group that
        changed and has output, engine request ids stopped here by a stop string)."""
        if prompt_logprobs:
            self._add_prompt_logprobs(prompt_logprobs)
        changed: dict[str, RequestState] = {}
        stopped: list[str] = []
        seq_of = self.seq_of
        for out in outputs:  # per token of every running request: kept lean
            entry = seq_of.get(out[0])
            if entry is None:  # aborted meanwhile
                continue
            group, seq = entry
            if seq.plain and out[3] is None:  # what _append would do for it, without the call
                seq.token_ids.append(out[1])
                new = seq.detok.add(out[1])
                if new:
                    seq.text += new
            else:
                if self._append(seq, out):
                    stopped.append(seq.req_id)
                if seq.finish_reason is not None:
                    del seq_of[seq.req_id]
            if seq.index == 0:
                group.num_cached_tokens = out[6]
            changed[group.request_id] = group
        output = self._output
        return [output(g) for g in changed.values() if not g.final_only or g.finished], stopped

    def _add_prompt_logprobs(self, prompt_logprobs: dict) -> None:
        """File prompt log-probs under their groups; a group's list is complete once every prompt
        position after the first has its entry."""
        decode = self.tokenizer.decode
        for rid, entries in prompt_logprobs.items():
            found = self.seq_of.get(rid)
            if found is None or found[0].prompt_lp is None:
                continue
            group = found[0]
            for pos, token, lp, rank, top in entries:  # pos: the position of `token` in the prompt
                e = {token: Logprob(lp, rank=rank, decoded_token=decode([token], False))}
                for r, (t, v) in enumerate(top, start=1):
                    e.setdefault(t, Logprob(v, rank=r, decoded_token=decode([t], False)))
                group.prompt_lp[pos] = e
            n = len(group.prompt_ids)
            if group.prompt_logprobs is None and len(group.prompt_lp) == n - 1:
                group.prompt_logprobs = [None] + [group.prompt_lp[i] for i in range(1, n)]

    def _append(self, seq: _Sequence, out: tuple) -> bool:
        """Apply one sampled token: logprobs, detokenisation, stop strings; True when a stop string
        ended the sequence here (the core does not know yet)."""
        _, token, lp, finish, stop_reason, num_out, _ = out
        p = seq.params
        seq.token_ids.append(token)
        if seq.logprobs is not None and lp is not None:
            decode = self.tokenizer.decode
            value, rank, top = lp
            e = {token: Logprob(value, rank=rank, decoded_token=decode([token], False))}
            for r, (t, v) in enumerate(top or (), start=1):
                e.setdefault(t, Logprob(v, rank=r, decoded_token=decode([t], False)))
            seq.logprobs.append(e)
            seq.cumulative_logprob += value
        cut = False
        if finish == "stop":  # a stop token id (stop_reason) or EOS (None)
            if stop_reason is not None and p.include_stop_str_in_output and p.detokenize:
                seq.text += seq.detok.add(token)
        elif p.detokenize:
            before = len(seq.text)
            new = seq.detok.add(token)
            seq.text += new
            if p.stop and new and num_out >= p.min_tokens:
                # Only where a stop string could newly end: it must take in some of the new text.
                # Held-back deltas (see _output) guarantee nothing from here on was sent.
                start = max(0, before - seq.max_stop_len + 1)
                found = [(at, s) for s in p.stop if (at := seq.text.find(s, start)) >= 0]
                if found:
                    at, s = min(found, key=lambda f: (f[0], -len(f[1])))  # the earliest one
                    seq.text = seq.text[:at + (len(s) if p.include_stop_str_in_output else 0)]
                    stopped_here = finish is None
                    finish, stop_reason, cut = "stop", s, True
                    seq.finish_reason, seq.stop_reason = finish, stop_reason
                    return stopped_here
        if finish is not None:
            if not cut and p.detokenize:
                seq.text += seq.detok.finish()
            seq.finish_reason, seq.stop_reason = finish, stop_reason
        return False

    def _output(self, group: RequestState) -> RequestOutput:
        outs = []
        finished = True
        for seq in group.seqs:
            # Hold back text that could still become the start of a stop string.
            if seq.finish_reason is None:
                finished = False
                upto = max(seq.sent_text, len(seq.text) - seq.hold) if seq.hold else len(seq.text)
            else:
                upto = len(seq.text)
            text = seq.text[seq.sent_text:upto] if upto != seq.sent_text else ""
            ids = seq.token_ids[seq.sent_tokens:]
            lps = None
            if seq.logprobs is not None:
                lps = seq.logprobs[seq.sent_logprobs:]
                seq.sent_logprobs = len(seq.logprobs)
            seq.sent_text, seq.sent_tokens = upto, len(seq.token_ids)
            outs.append(CompletionOutput(seq.index, text, ids, seq.cumulative_logprob, lps, seq.finish_reason,
                                         seq.stop_reason))
        if finished:
            self.groups.pop(group.request_id, None)
        return RequestOutput(group.request_id, group.prompt, group.prompt_ids, outs, finished,
                             group.num_cached_tokens, delta=True, prompt_logprobs=group.prompt_logprobs)
