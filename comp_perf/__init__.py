"""The code behind common.py, the course's map: one module per part of the course (see common.py)."""
