"""Small, real models and plans used by the command line, the benchmarks and the tests."""
