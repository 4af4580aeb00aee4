"""Token sampling from logits (greedy, temperature, top-k / top-p, seeded Gumbel-max coupling),
shared by the engine's plain path, the drafters and the rejection sampler."""
