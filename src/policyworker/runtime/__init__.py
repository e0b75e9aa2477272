"""process groups, the watchdog, the control endpoint, devices, processes (docs/architecture.md)."""
