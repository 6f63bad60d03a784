"""Benchmarking and plotting helpers around the library core (not used by it).

``head_bench``: head latency benchmark (ν), torch only, with a plain CLI for GPU boxes without
Hydra (``python -m flashspec.analysis.head_bench``). ``head_plot``: predicted vs measured ρ_TPS.
``bandit_plot``: regret vs T. ``bandit_stream_plot``: drafter choice on a real decoding stream.
``notebook_inputs``: the notebooks' inputs from their environment variables (``FLASHSPEC_SWEEP``
and the others), with a one-line stop on a missing or empty one.
Nothing here is imported by ``flashspec``'s core modules; modules are imported by name (this
package imports nothing, so the torch-only bench stays torch-only).
"""
