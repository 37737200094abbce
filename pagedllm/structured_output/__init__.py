"""Structured outputs: grammar-constrained decoding on xgrammar (imported only by the modules that need it)."""
