"""The engine: requests, paged KV cache with prefix caching, scheduler, runner, sampler."""
