"""Elastic spot-instance training orchestrator.

Data flows one way: market -> bidbrain -> cloud -> agileml -> metrics.
"""

__version__ = "0.1.0"
