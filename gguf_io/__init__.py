from gguf_io.reader import GGUFError, GGUFFile, TensorInfo, open_gguf

__all__ = ["GGUFError", "GGUFFile", "TensorInfo", "open_gguf"]
