"""Attention kernels, one file per backend, all called with one ``Call`` record."""
