"""SGLang: the in-process engine adapter (the HTTP client is the sglang_ipc transport's, in transports/sglang_ipc/client.py)."""
