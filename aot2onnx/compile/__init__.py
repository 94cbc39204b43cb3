"""The ``torch.compile`` backend: options -> capture -> cache -> lower (or fall back) -> runtime."""
