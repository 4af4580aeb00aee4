"""Engine core: block KV cache, scheduler, model runner, sampler, sync and async engines.

Imports no Ray, gRPC or pydantic: deployments wrap and inject it.
"""
