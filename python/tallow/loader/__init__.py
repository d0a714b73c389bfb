"""Everything from "a model name or path" to config + weights as tallow tensors."""
