"""the trainer and rollout workers over the generic road (core: attach/refit/detach) (docs/architecture.md)."""
