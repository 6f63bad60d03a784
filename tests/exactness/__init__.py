"""Helpers of the statistical exactness gate: statistics, synthetic tables, the multi-step
speculative sampling harness, drafter choosers and planted (buggy) verify variants.

Everything here is test code: the planted bugs live here, never in ``flashspec``.
"""
