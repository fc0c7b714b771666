"""Structured output: grammars the sampled tokens must follow (issue 31).

`request` turns the API's fields (response_format, vLLM's guided_* and structured_outputs)
into one `StructuredOutput` in SamplingParams (light: no torch, runs in the API server);
`grammars` compiles it with xgrammar (cached per grammar) and keeps each request's matcher,
whose token bitmask the sampler applies to the logits (runs where the model runs).
"""
