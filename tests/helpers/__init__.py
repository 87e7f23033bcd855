"""What several test files share: tiny trainers and configs, launches of several processes, resume comparisons, stub
servers, the tolerances; imported as ``helpers.<module>`` (tests/conftest.py puts tests/ on the path)."""
