"""Structured outputs: grammar-constrained decoding on xgrammar.

- :mod:`backend_xgrammar`: spec → grammar, validation (errors name the field), compiles, matchers.
- :mod:`manager`: the compile cache (keyed by tokenizer and spec, compiled off the step
  loop), one matcher per request synced to its output, the step's bitmask.
- :mod:`bitmask`: the one batched application of the bitmask to the logits (model runner).

Importing this package does not import xgrammar or torch; the modules that need them do.
"""
