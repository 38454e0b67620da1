"""meshwatch backend: API, storage, analysis engine, actions, dashboard."""
