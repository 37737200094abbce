"""Speculative decoding's drafting side (no torch): proposers, and the drafter that decides
which requests draft how many tokens each step. Verification is the model runner's."""
