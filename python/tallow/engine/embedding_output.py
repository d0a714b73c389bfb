"""What `LLM.embed` returns, shaped like vLLM's EmbeddingRequestOutput (outputs.embedding is a list of floats)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]  # the pooled final hidden state, L2-normalised unless normalize=False

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
