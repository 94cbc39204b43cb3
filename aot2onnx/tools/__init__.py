"""Tools on top of the pipeline: the benchmark, the coverage tables and the command line (``python -m aot2onnx``)."""
