"""Fixtures of the model tests (attnbench.models: the TabPFN-like decode loop on shared_context attention):
none of their own yet."""
