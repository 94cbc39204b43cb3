"""The training artifact: export (``export.py``), optimizer models (``optim.py``), the torch-free trainer
(``edge.py``, one file a device copies; it also defines the format's names) and ``aot2onnx.load`` (``loaded.py``).

Nothing is imported here: ``python -m aot2onnx.artifact.edge`` must not find edge imported already.
"""
