"""Loaders for real pretrained checkpoints, built from multihead's own modules."""
