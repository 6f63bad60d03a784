"""Training of feature-level (EAGLE-style) drafters: data generation, training loop, checkpoints.

``python -m flashspec.training --out DIR [--device cuda]`` runs a job without Hydra or W&B;
``python run.py experiment=train_drafter`` is the Hydra entry.
"""
