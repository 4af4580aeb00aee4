"""Models: resolving a model source to a local Hugging Face directory, our Llama-family forward pass
over the block KV cache, and the Hugging Face fallback runner for other architectures."""
