"""Small models built on the operators, used end to end (the TabPFN-like decode loop)."""
