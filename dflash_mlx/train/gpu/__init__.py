"""The recipe on one CUDA machine with PyTorch (no MLX there): `train_torch.py`, run as a script."""
