"""Measure layers and collectives on the present hardware, and calibrate the cost model with them."""
