"""The commands: main.py parses them and runs each (serve.py, generate.py, demo.py, bench.py, and
the worker's and the coordinator's in worker/ and coordinator/)."""
