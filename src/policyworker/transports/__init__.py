"""Built-in transports. Each module is imported only when its transport is chosen."""
