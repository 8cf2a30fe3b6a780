"""Spot market knowledge: price history sources, instance catalog, billing, eviction risk."""
