"""Training of feature-level (EAGLE-style) drafters: data generation, training loop, checkpoints.

``python run.py experiment=train_drafter`` runs a job (``flashspec.training.run``).
"""
