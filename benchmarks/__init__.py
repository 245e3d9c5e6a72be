"""shardwire's benchmarks, each run from the repository's root as `python -m benchmarks.NAME`
(the usage is at the top of each); they import each other and the tests' helpers
(tests/support/) as packages."""
