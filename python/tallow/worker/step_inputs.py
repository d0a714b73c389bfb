"""The index tensors of one model step (token ids, positions, KV slots, sequence lengths, query
starts, block tables, rows to sample), built on the host and moved to the model's device.

On a GPU they live in two static device buffers (one i32, one i64) allocated once, so each step
costs two host-to-device copies and CUDA graphs can keep pointing at the same addresses; the
tensors a step hands to the model are views of their leading rows. On the CPU the host arrays are
used directly (zero-copy)."""
from __future__ import annotations

import numpy as np

import tallow
from tallow.layers.attention import AttentionMetadata


class StepInputs:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: str):
        self.max_tokens, self.max_seqs, self.width = int(max_tokens), int(max_seqs), int(max_blocks_per_seq)
        self.device = device
        t, b, w = self.max_tokens, self.max_seqs, self.width
        # i32: ids [t] | seq_lens [b] | query_start_loc [b + 1] | prefill query starts [b + 1] | block_tables [b, w]
        self._o_seq, self._o_qsl, self._o_pqsl, self._o_bt = t, t + b, t + 2 * b + 1, t + 3 * b + 2
        self.i32 = np.zeros(self._o_bt + b * w, dtype=np.int32)
        # i64: positions [t] | slot_mapping [t] | rows to sample [b]
        self.i64 = np.zeros(2 * t + b, dtype=np.int64)
        self.ids = self.i32[:t]
        self.seq_lens = self.i32[self._o_seq:self._o_qsl]
        self.qsl = self.i32[self._o_qsl:self._o_pqsl]
        self.prefill_qsl = self.i32[self._o_pqsl:self._o_bt]  # query starts of the sequences after the decodes
        self.bt = self.i32[self._o_bt:].reshape(b, w)
        self.pos = self.i64[:t]
        self.slots = self.i64[t:2 * t]
        self.rows = self.i64[2 * t:]
        # Per block-table row: (the request's block-id list, how many of its ids the row holds). A
        # request's list only grows while it lives (a preempted request gets a new list), so a row
        # that held the same list last step needs only the new ids.
        self._bt_rows: list = [None] * b
        if device == "cpu":
            self.d_i32, self.d_i64 = tallow.from_numpy(self.i32), tallow.from_numpy(self.i64)
        else:
            self.d_i32 = tallow.empty([self.i32.size], tallow._core.dtype("int32"), device)
            self.d_i64 = tallow.empty([self.i64.size], tallow._core.dtype("int64"), device)
            self.d_i32.copy_(tallow.from_numpy(self.i32))
            self.d_i64.copy_(tallow.from_numpy(self.i64))

    def set_block_row(self, i: int, block_ids: list[int]) -> None:
        """Row i of the block tables holds block_ids (the KV manager's list for one request)."""
        n, prev = len(block_ids), self._bt_rows[i]
        if prev is not None and prev[0] is block_ids and prev[1] <= n:
            if prev[1] < n:
                self.bt[i, prev[1]:n] = block_ids[prev[1]:]
        else:
            self.bt[i, :n] = block_ids
        self._bt_rows[i] = (block_ids, n)

    def forget_block_rows(self, start: int = 0, stop: int = None) -> None:
        """Rows start..stop-1 were written otherwise: set_block_row rewrites them whole."""
        stop = self.max_seqs if stop is None else stop
        self._bt_rows[start:stop] = [None] * (stop - start)

    @property
    def nbytes(self) -> int:
        return self.i32.nbytes + self.i64.nbytes

    def upload(self, num_seqs: int) -> None:
        """Send the host arrays to the device (only the used block-table rows)."""
        if self.device == "cpu":
            return
        n32 = self._o_bt + num_seqs * self.width
        self.d_i32.narrow(0, 0, n32).copy_(tallow.from_numpy(self.i32[:n32]))
        self.d_i64.copy_(tallow.from_numpy(self.i64))

    def set_decode_prefix(self, num_decode_seqs: int, num_seqs: int) -> None:
        """Record that the first num_decode_seqs sequences have one query each: prefill_qsl gets the
        query starts of the others, rebased to 0 (AttentionMetadata then splits mixed steps)."""
        nd = num_decode_seqs
        self.prefill_qsl[:num_seqs - nd + 1] = self.qsl[nd:num_seqs + 1] - self.qsl[nd]

    def views(self, num_tokens: int, num_seqs: int, num_rows: int = 0, num_decode_seqs: int = 0):
        """(input ids, positions, AttentionMetadata, rows to sample) over the device buffers. With
        0 < num_decode_seqs < num_seqs (set_decode_prefix called) the metadata describes a mixed step."""
        t = self.max_tokens
        d32, d64 = self.d_i32, self.d_i64
        mixed = 0 < num_decode_seqs < num_seqs
        meta = AttentionMetadata(
            slot_mapping=d64.narrow(0, t, num_tokens),
            block_tables=d32.narrow(0, self._o_bt, num_seqs * self.width).view(num_seqs, self.width),
            seq_lens=d32.narrow(0, self._o_seq, num_seqs),
            query_start_loc=d32.narrow(0, self._o_qsl, num_seqs + 1),
            num_tokens=num_tokens,
            num_decode_seqs=num_decode_seqs if mixed else 0,
            prefill_query_start_loc=d32.narrow(0, self._o_pqsl, num_seqs - num_decode_seqs + 1) if mixed else None)
        return d32.narrow(0, 0, num_tokens), d64.narrow(0, 0, num_tokens), meta, d64.narrow(0, 2 * t, num_rows)

    def fill_padding(self, start: int, stop: int, num_tokens_before: int) -> None:
        """Rows start..stop-1 become one-token dummy sequences (token 0 at position 0, no KV slot,
        length 1, block 0) so a batch can be padded up to a captured graph's size."""
        n = stop - start
        if n <= 0:
            return
        self.ids[num_tokens_before:num_tokens_before + n] = 0
        self.pos[num_tokens_before:num_tokens_before + n] = 0
        self.slots[num_tokens_before:num_tokens_before + n] = -1
        self.seq_lens[start:stop] = 1
        self.qsl[start + 1:stop + 1] = np.arange(num_tokens_before + 1, num_tokens_before + n + 1)
        self.bt[start:stop, 0] = 0
        self.forget_block_rows(start, stop)
