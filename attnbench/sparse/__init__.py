"""Sparse operators: block-sparse and structured-sparse products (so3: the SO(3) tensor-product structure)."""
