"""Pure functions on sample bytes: image checks/normalization, probing rules, tokenization."""
